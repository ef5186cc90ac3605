#pragma once
// The node's image cache and the one-pass write of an image onto a slot's boot disk.
//
// Cache: <dir>/<sha256>.img is the catalog image exactly as its digest describes (fetched over
// file://, http:// or https:// with libcurl, hashed while it arrives, resumed after a broken
// connection or an agent restart from <sha256>.partial, verified before it is renamed into
// place). A qcow2 image is converted once into <sha256>.raw, whose own digest is recorded; the
// qcow2 is then dropped. <sha256>.json records what the entry is (format, the raw file, its
// digest, size and file identity): an entry whose raw file's identity (device, inode, size,
// mtime) no longer matches is refetched. Concurrent provisions of one image share one download
// (an flock on <sha256>.lock: one fetch per digest at a time, in this process and across
// processes).
//
// Write: the raw file is mapped and read once: one thread hashes it while another writes the
// same page-cache pages onto the disk in 4 MiB pieces (O_DIRECT on a block device, so no copy and
// no page cache on the way out; O_EXCL so nothing mounts it meanwhile); the first piece - the
// partition table and boot sector - is zeroed first and written only after the whole digest
// matched, so a disk whose image did not verify never boots.
#include <chrono>
#include <cstdint>
#include <string>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/node.pb.h"

namespace gpuaas::node_agent {

struct ImageCacheOptions {
  std::string dir;                                           // required
  std::string tools_root = "/";                              // where qemu-img is looked up
  std::chrono::milliseconds timeout{std::chrono::hours(1)};  // one fetch or conversion
  // A transient fetch failure (connection refused or reset, a stall, HTTP 5xx/408/429) is
  // retried, resuming where it stopped, this many times in all, with a doubling delay.
  int fetch_attempts = 5;
  std::chrono::milliseconds retry_delay{std::chrono::seconds(1)};
  std::chrono::seconds stall_timeout{std::chrono::seconds(60)};  // no byte for this long
};

// An image ready to be written: raw bytes at `path`.
struct CachedImage {
  std::string name;    // the catalog name
  std::string path;    // the raw file in the cache
  std::string format;  // the catalog image's own format: raw | qcow2
  uint64_t size = 0;   // bytes at path: what lands on the disk
  std::string sha256;  // digest of the bytes at path (the catalog's for a raw image)
};

class ImageCache {
 public:
  explicit ImageCache(ImageCacheOptions opts);
  ~ImageCache();
  ImageCache(const ImageCache&) = delete;
  ImageCache& operator=(const ImageCache&) = delete;

  // The image's raw bytes in the cache, fetched (and converted) when missing. Stage "image";
  // reasons: image_url_unsupported, image_not_found, image_fetch_failed (retryable when the
  // attempts ran out on transient failures), image_digest_mismatch, image_unreadable,
  // image_has_backing_file, image_format_unsupported, image_cache_unusable.
  Result<CachedImage> Ensure(const v1::ImageRef& image, const ProgressFn& progress);
  // Drops the entry of `sha256` (its raw copy no longer matched its digest while written).
  void Evict(const std::string& sha256);

 private:
  ImageCacheOptions opts_;
};

struct WriteStats {
  double seconds = 0;  // the whole pass, head and sync included
};

// Writes `image` onto the disk at `path` (`block`: a block device of `size` bytes; else a
// regular file, grown to the image's size when smaller - fixture hosts only) in one pass, as the
// header says. Stage "image"; reasons: disk_too_small, image_write_failed, image_changed (the
// cached file changed under the write), image_digest_mismatch (details expected_sha256,
// actual_sha256; the disk's first chunk stays zero). Reports progress 50..99 with bytes.
Result<WriteStats> WriteImage(const CachedImage& image, const std::string& path, bool block,
                              uint64_t size, std::chrono::milliseconds timeout,
                              const ProgressFn& progress);

// sha256 of a whole file, 64 lowercase hex digits (OpenSSL; one sequential read).
Result<std::string> Sha256File(const std::string& path);

}  // namespace gpuaas::node_agent
