#!/usr/bin/env python3
"""A small HTTP image server for the node-agent's image cache tests (ImageCacheTest).

Serves the files of DIR on 127.0.0.1 (a free port, written to --port-file) with byte ranges
("Range: bytes=N-" answered 206 with Content-Range), and misbehaves on request:
  --cut NAME:BYTES   the first GET of NAME announces the whole length, sends BYTES bytes and drops
                     the connection (a broken download to resume)
  --no-range         ignores Range headers (always 200 with the whole file)
  --chunk-delay-ms N sleeps N ms after every 64 KiB (a slow download others must wait for)
Every request is appended to --log as "GET /NAME RANGE STATUS" (RANGE "-" when none).
"""
import argparse
import http.server
import os
import re
import threading
import time

args = None
cuts = {}
lock = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet: the request log is --log
        pass

    def record(self, rng, status):
        with lock, open(args.log, "a") as f:
            f.write(f"GET {self.path} {rng or '-'} {status}\n")

    def do_GET(self):
        name = self.path.lstrip("/")
        path = os.path.join(args.dir, name)
        rng = self.headers.get("Range")
        if "/" in name or not os.path.isfile(path):
            self.record(rng, 404)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        start = 0
        status = 200
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if m and not args.no_range:
            start = int(m.group(1))
            if start >= size:
                self.record(rng, 416)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        cut = None
        with lock:
            if name in cuts:
                cut = cuts.pop(name)
        self.record(rng, status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.send_header("Accept-Ranges", "none" if args.no_range else "bytes")
        self.end_headers()
        sent = 0
        with open(path, "rb") as f:
            f.seek(start)
            while True:
                block = f.read(65536)
                if not block:
                    break
                if cut is not None and sent + len(block) > cut:
                    self.wfile.write(block[: cut - sent])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(block)
                sent += len(block)
                if args.chunk_delay_ms:
                    time.sleep(args.chunk_delay_ms / 1000)


def main():
    global args
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--port-file", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--cut", action="append", default=[])
    p.add_argument("--no-range", action="store_true")
    p.add_argument("--chunk-delay-ms", type=int, default=0)
    args = p.parse_args()
    for c in args.cut:
        name, n = c.rsplit(":", 1)
        cuts[name] = int(n)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(srv.server_address[1]))
    os.rename(tmp, args.port_file)
    srv.serve_forever()


if __name__ == "__main__":
    main()
