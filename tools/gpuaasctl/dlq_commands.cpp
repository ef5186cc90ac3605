// gpuaasctl dlq list|show|replay|discard: the dead letters of stream GPUAAS_DLQ (what a durable
// consumer gave up on because it can never succeed). list and show read the stream
// ($JS.API.STREAM.MSG.GET, the operator's read_streams); replay asks the service that owns the
// dead letter's consumer (the contract's x-gpuaas-access consumers; node-<id> -> inventory) to run
// that consumer's handler on it again, which is idempotent; discard deletes it (operators only).
// A replay does not delete the dead letter: discard it once it is applied.
#include <google/protobuf/util/json_util.h>

#include <iostream>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ctl.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/dlq.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::ctl {

namespace {

using json = nlohmann::ordered_json;

struct Letter {
  dlq::Entry entry;
  v1::DeadLetter dl;
  bool parsed = false;
};

Letter Decode(dlq::Entry e) {
  Letter l;
  l.parsed = l.dl.ParseFromString(e.data);
  l.entry = std::move(e);
  return l;
}

// Printable bytes as they are, the rest escaped (\xNN).
std::string Escaped(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

// The payload as a gpuaas.v1.Event when it is one (an envelope with an id or a type).
std::optional<v1::Event> AsEvent(const std::string& payload) {
  v1::Event ev;
  if (!ev.ParseFromString(payload) || (ev.id().empty() && ev.type().empty())) return std::nullopt;
  return ev;
}

json ToObject(const google::protobuf::Message& m) {
  return json::parse(ToJson(m, false), nullptr, false);
}

json LetterJson(const Letter& l, bool with_payload) {
  json j;
  j["dlq_sequence"] = l.entry.sequence;
  j["dlq_subject"] = l.entry.subject;
  if (!l.parsed) {
    j["malformed"] = true;
    return j;
  }
  v1::DeadLetter shown = l.dl;
  shown.clear_payload();
  const json fields = ToObject(shown);
  if (fields.is_object()) {
    for (auto it = fields.begin(); it != fields.end(); ++it) j[it.key()] = it.value();
  }
  if (with_payload) {
    if (auto ev = AsEvent(l.dl.payload())) {
      j["payload_event"] = ToObject(*ev);
    } else {
      j["payload_escaped"] = Escaped(l.dl.payload());
    }
  }
  return j;
}

void PrintJson(const Globals& g, const json& j) {
  std::cout << (g.json_lines ? j.dump() : j.dump(2)) << "\n" << std::flush;
}

}  // namespace

DlqAction AddDlqCommands(CLI::App& app) {
  auto* dlq_cmd = app.add_subcommand(
      "dlq", "Dead letters: what a consumer gave up on (list, show, replay, discard)");
  dlq_cmd->require_subcommand(1);

  struct Flags {
    std::string consumer, stream;
    size_t limit = 50;
    uint64_t seq = 0;
    bool yes = false;
  };
  auto f = std::make_shared<Flags>();
  auto* list = dlq_cmd->add_subcommand("list", "The newest dead letters, newest first");
  list->add_option("--consumer", f->consumer, "Only this durable consumer's");
  Suggest(list->add_option("--stream", f->stream, "Only those from this stream"),
          {"GPUAAS_EVT_INVENTORY", "GPUAAS_EVT_SCHEDULER", "GPUAAS_EVT_IPAM", "GPUAAS_EVT_INGRESS",
           "GPUAAS_EVT_CONSOLE", "GPUAAS_EVT_NODE", "GPUAAS_NODE_TASKS"});
  list->add_option("--limit", f->limit, "At most this many")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  auto* show = dlq_cmd->add_subcommand("show", "One dead letter, its payload decoded");
  auto* replay = dlq_cmd->add_subcommand(
      "replay",
      "Run the consumer's handler on it again, in the service that owns the consumer "
      "(idempotent); the dead letter stays until discarded");
  auto* discard = dlq_cmd->add_subcommand("discard", "Delete a dead letter for good");
  for (auto* c : {show, replay, discard}) {
    c->add_option("--seq", f->seq, "The dead letter's sequence in GPUAAS_DLQ (dlq list)")
        ->required()
        ->check(CLI::PositiveNumber);
  }
  discard->add_flag("--yes", f->yes, "Confirm: the dead letter cannot be recovered");

  return [=](messaging::Connection& conn, rpc::Client& client,
             const Globals& g) -> std::optional<int> {
    if (!dlq_cmd->parsed()) return std::nullopt;
    if (list->parsed()) {
      auto entries = dlq::ListNewest(conn, f->stream, f->consumer, f->limit);
      if (!entries.ok()) return Fail(g, entries.error());
      std::vector<Letter> letters;
      letters.reserve(entries->size());
      for (auto& e : *entries) letters.push_back(Decode(std::move(e)));
      if (g.Json()) {
        json j;
        j["dead_letters"] = json::array();
        for (const auto& l : letters) j["dead_letters"].push_back(LetterJson(l, false));
        PrintJson(g, j);
        return kExitOk;
      }
      std::vector<std::vector<std::string>> rows;
      rows.reserve(letters.size());
      for (const auto& l : letters) {
        if (!l.parsed) {
          rows.push_back({std::to_string(l.entry.sequence), "-", l.entry.subject, "-", "-",
                          "not a gpuaas.v1.DeadLetter"});
          continue;
        }
        rows.push_back({std::to_string(l.entry.sequence), Time(l.dl.time()),
                        l.dl.stream() + "/" + l.dl.consumer(), l.dl.subject(), Or(l.dl.kind()),
                        l.dl.reason()});
      }
      PrintTable({"SEQ", "TIME", "STREAM/CONSUMER", "SUBJECT", "KIND", "REASON"}, rows);
      return kExitOk;
    }

    auto entry = dlq::Get(conn, f->seq);
    if (!entry.ok()) return Fail(g, entry.error());
    Letter l = Decode(*entry);
    if (show->parsed()) {
      if (g.Json()) {
        PrintJson(g, LetterJson(l, true));
        return kExitOk;
      }
      std::cout << fmt::format("dlq sequence:    {}\n", l.entry.sequence);
      if (!l.parsed) {
        std::cout << fmt::format("subject:         {}\nnot a gpuaas.v1.DeadLetter: {}\n",
                                 l.entry.subject, Escaped(l.entry.data));
        return kExitOk;
      }
      const auto& dl = l.dl;
      std::cout << fmt::format(
          "time:            {}\nstream:          {}\nconsumer:        {}\nsubject:         {}\n"
          "stream sequence: {}\ndeliveries:      {}\nkind:            {}\nreason:          {}\n",
          Time(dl.time()), dl.stream(), dl.consumer(), dl.subject(), dl.stream_sequence(),
          dl.deliveries(), Or(dl.kind()), dl.reason());
      std::map<std::string, std::string> headers(dl.headers().begin(), dl.headers().end());
      for (const auto& [k, v] : headers) {
        std::cout << fmt::format("header:          {}: {}\n", k, v);
      }
      if (auto ev = AsEvent(dl.payload())) {
        std::cout << "payload (gpuaas.v1.Event):\n" << ToJson(*ev) << "\n";
      } else {
        std::cout << fmt::format("payload ({} bytes): {}\n", dl.payload().size(),
                                 Escaped(dl.payload()));
      }
      return kExitOk;
    }
    if (discard->parsed()) {
      if (!f->yes) {
        return Usage(
            g, Error::InvalidArgument(
                   "confirm_required",
                   fmt::format("discard deletes dead letter {} for good; pass --yes", f->seq)));
      }
      if (auto r = dlq::Delete(conn, f->seq); !r.ok()) return Fail(g, r.error());
      if (g.Json()) {
        json j;
        j["dlq_sequence"] = f->seq;
        j["discarded"] = true;
        PrintJson(g, j);
      } else {
        std::cout << fmt::format("discarded dead letter {}\n", f->seq);
      }
      return kExitOk;
    }
    // replay
    if (!l.parsed) {
      return Fail(g, Error::FailedPrecondition(
                         "dead_letter_malformed",
                         fmt::format("sequence {} is not a gpuaas.v1.DeadLetter", f->seq)));
    }
    auto service = dlq::ReplayServiceOf(access::EmbeddedContract(), l.dl.stream(), l.dl.consumer());
    if (!service.ok()) return Fail(g, service.error());
    v1::ReplayDeadLetterRequest req;
    req.set_dlq_sequence(f->seq);
    auto r =
        client.Call<v1::ReplayDeadLetterResponse>(dlq::ReplaySubject(*service), req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    const auto outcome = r->outcome();
    Print(g, *r, [&] {
      switch (outcome) {
        case v1::REPLAY_OUTCOME_APPLIED:
          std::cout << fmt::format(
              "applied by {} ({}); discard it with `gpuaasctl dlq discard "
              "--seq {} --yes`\n",
              *service, r->consumer(), f->seq);
          break;
        case v1::REPLAY_OUTCOME_DUPLICATE:
          std::cout << fmt::format("already applied by {} ({}): nothing changed\n", *service,
                                   r->consumer());
          break;
        case v1::REPLAY_OUTCOME_REPUBLISHED:
          std::cout << fmt::format("re-published to {} (GPUAAS_NODE_TASKS sequence {})\n",
                                   r->subject(), r->republished_sequence());
          break;
        case v1::REPLAY_OUTCOME_REJECTED:
          std::cout << fmt::format("rejected again by {} ({}, {}): {}\n", *service, r->consumer(),
                                   r->kind(), r->reason());
          break;
        default:
          std::cout << fmt::format("not applied, retry later ({}): {}\n", *service, r->reason());
          break;
      }
    });
    const bool done = outcome == v1::REPLAY_OUTCOME_APPLIED ||
                      outcome == v1::REPLAY_OUTCOME_DUPLICATE ||
                      outcome == v1::REPLAY_OUTCOME_REPUBLISHED;
    return done ? kExitOk : kExitOutcome;
  };
}

}  // namespace gpuaas::ctl
