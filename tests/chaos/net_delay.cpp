// gpuaas-net-delay: holds every packet of an NFQUEUE for a fixed time, then accepts it, in the
// order they came: the chaos campaign's added latency (net_faults.hpp). `tc netem` would do it
// in the kernel, but not every kernel has sch_netem; the queue's verdicts are the kernel's own.
//   gpuaas-net-delay --queue 7 --delay-ms 200
// Runs until SIGTERM/SIGINT; the rule that feeds it uses --queue-bypass, so packets pass
// undelayed once it is gone.
#include <arpa/inet.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <iostream>

#include <CLI/CLI.hpp>

extern "C" {
#include <libnetfilter_queue/libnetfilter_queue.h>
}

namespace {

using Clock = std::chrono::steady_clock;

struct Held {
  Clock::time_point due;
  uint32_t id;
};

struct State {
  std::chrono::milliseconds delay{200};
  std::deque<Held> held;  // in arrival order, so in due order
};

volatile sig_atomic_t g_stop = 0;

int OnPacket(nfq_q_handle* /*qh*/, nfgenmsg* /*msg*/, nfq_data* nfa, void* data) {
  auto* st = static_cast<State*>(data);
  const nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(nfa);
  if (ph != nullptr) st->held.push_back({Clock::now() + st->delay, ntohl(ph->packet_id)});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int queue = 0;
  int delay_ms = 200;
  CLI::App app{"gpuaas-net-delay: delays every packet of an NFQUEUE (the chaos campaign)"};
  app.add_option("--queue", queue, "NFQUEUE number")->required();
  app.add_option("--delay-ms", delay_ms, "How long each packet is held")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  signal(SIGTERM, [](int) { g_stop = 1; });
  signal(SIGINT, [](int) { g_stop = 1; });
  State st;
  st.delay = std::chrono::milliseconds(delay_ms);
  nfq_handle* h = nfq_open();
  if (h == nullptr) {
    std::cerr << "nfq_open failed\n";
    return 1;
  }
  nfq_q_handle* qh = nfq_create_queue(h, static_cast<uint16_t>(queue), &OnPacket, &st);
  if (qh == nullptr || nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) {
    std::cerr << "cannot bind queue " << queue << "\n";
    return 1;
  }
  nfq_set_queue_maxlen(qh, 65536);
  // A full queue lets packets through rather than dropping them: this fault is latency only.
  nfq_set_queue_flags(qh, NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_FAIL_OPEN);
  const int fd = nfq_fd(h);
  std::cout << "delaying queue " << queue << " by " << delay_ms << " ms" << std::endl;
  char buf[65536];
  while (g_stop == 0) {
    const auto now = Clock::now();
    while (!st.held.empty() && st.held.front().due <= now) {
      nfq_set_verdict(qh, st.held.front().id, NF_ACCEPT, 0, nullptr);
      st.held.pop_front();
    }
    int wait_ms = 100;
    if (!st.held.empty()) {
      wait_ms = static_cast<int>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(st.held.front().due - now)
                        .count()) +
                1;
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, wait_ms) > 0) {
      const auto n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) nfq_handle_packet(h, buf, static_cast<int>(n));
    }
  }
  // What is still held goes through now.
  for (const auto& p : st.held) nfq_set_verdict(qh, p.id, NF_ACCEPT, 0, nullptr);
  nfq_destroy_queue(qh);
  nfq_close(h);
  return 0;
}
