// gpuaasctl dlq list|show|replay|discard: the dead letters of stream GPUAAS_DLQ (what a durable
// consumer gave up on because it can never succeed). list and show read the stream
// ($JS.API.STREAM.MSG.GET, the operator's read_streams); replay asks the service that owns the
// dead letter's consumer (the contract's x-gpuaas-access consumers; node-<id> -> inventory) to run
// that consumer's handler on it again, which is idempotent; discard deletes it (operators only).
// A replay does not delete the dead letter: discard it once it is applied.
#include <google/protobuf/util/json_util.h>

#include <iostream>
#include <map>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/dlq.hpp"
#include "gpuaas/common/reasons.hpp"
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

void PrintLetters(const Globals& g, const std::vector<Letter>& letters) {
  if (g.Json()) {
    json j;
    j["dead_letters"] = json::array();
    for (const auto& l : letters) j["dead_letters"].push_back(LetterJson(l, false));
    PrintJson(g, j);
    return;
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
}

// dlq list: the newest dead letters, of a stream and/or a consumer.
DlqAction AddDlqList(CLI::App& dlq_cmd) {
  struct Opts {
    std::string consumer, stream;
    size_t limit = 50;
  };
  auto o = std::make_shared<Opts>();
  auto* list = dlq_cmd.add_subcommand("list", "The newest dead letters, newest first");
  list->add_option("--consumer", o->consumer, "Only this durable consumer's");
  Suggest(list->add_option("--stream", o->stream, "Only those from this stream"),
          {"GPUAAS_EVT_INVENTORY", "GPUAAS_EVT_SCHEDULER", "GPUAAS_EVT_IPAM", "GPUAAS_EVT_INGRESS",
           "GPUAAS_EVT_CONSOLE", "GPUAAS_EVT_NODE", "GPUAAS_NODE_TASKS"});
  list->add_option("--limit", o->limit, "At most this many")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  return [list, o](messaging::Connection& conn, rpc::Client& /*client*/,
                   const Globals& g) -> std::optional<int> {
    if (!list->parsed()) return std::nullopt;
    auto entries = dlq::ListNewest(conn, o->stream, o->consumer, o->limit);
    if (!entries.ok()) return Fail(g, entries.error());
    std::vector<Letter> letters;
    letters.reserve(entries->size());
    for (auto& e : *entries) letters.push_back(Decode(std::move(e)));
    PrintLetters(g, letters);
    return kExitOk;
  };
}

// --seq of the commands on one dead letter.
std::shared_ptr<uint64_t> AddSeqOption(CLI::App& command) {
  auto seq = std::make_shared<uint64_t>(0);
  command.add_option("--seq", *seq, "The dead letter's sequence in GPUAAS_DLQ (dlq list)")
      ->required()
      ->check(CLI::PositiveNumber);
  return seq;
}

// The dead letter at `seq`, decoded; nullopt (the error printed, its exit code in *rc) when it
// cannot be read.
std::optional<Letter> ReadLetter(messaging::Connection& conn, const Globals& g, uint64_t seq,
                                 int* rc) {
  auto entry = dlq::Get(conn, seq);
  if (!entry.ok()) {
    *rc = Fail(g, entry.error());
    return std::nullopt;
  }
  return Decode(*entry);
}

void PrintLetter(const Letter& l) {
  std::cout << fmt::format("dlq sequence:    {}\n", l.entry.sequence);
  if (!l.parsed) {
    std::cout << fmt::format("subject:         {}\nnot a gpuaas.v1.DeadLetter: {}\n",
                             l.entry.subject, Escaped(l.entry.data));
    return;
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
}

// dlq show: one dead letter, its payload decoded.
DlqAction AddDlqShow(CLI::App& dlq_cmd) {
  auto* show = dlq_cmd.add_subcommand("show", "One dead letter, its payload decoded");
  auto seq = AddSeqOption(*show);
  return [show, seq](messaging::Connection& conn, rpc::Client& /*client*/,
                     const Globals& g) -> std::optional<int> {
    if (!show->parsed()) return std::nullopt;
    int rc = kExitOk;
    auto l = ReadLetter(conn, g, *seq, &rc);
    if (!l) return rc;
    if (g.Json()) {
      PrintJson(g, LetterJson(*l, true));
    } else {
      PrintLetter(*l);
    }
    return kExitOk;
  };
}

void PrintReplay(const v1::ReplayDeadLetterResponse& r, const std::string& service, uint64_t seq) {
  switch (r.outcome()) {
    case v1::REPLAY_OUTCOME_APPLIED:
      std::cout << fmt::format(
          "applied by {} ({}); discard it with `gpuaasctl dlq discard "
          "--seq {} --yes`\n",
          service, r.consumer(), seq);
      break;
    case v1::REPLAY_OUTCOME_DUPLICATE:
      std::cout << fmt::format("already applied by {} ({}): nothing changed\n", service,
                               r.consumer());
      break;
    case v1::REPLAY_OUTCOME_REPUBLISHED:
      std::cout << fmt::format("re-published to {} (GPUAAS_NODE_TASKS sequence {})\n", r.subject(),
                               r.republished_sequence());
      break;
    case v1::REPLAY_OUTCOME_REJECTED:
      std::cout << fmt::format("rejected again by {} ({}, {}): {}\n", service, r.consumer(),
                               r.kind(), r.reason());
      break;
    default:
      std::cout << fmt::format("not applied, retry later ({}): {}\n", service, r.reason());
      break;
  }
}

int RunDlqReplay(messaging::Connection& conn, rpc::Client& client, const Globals& g, uint64_t seq) {
  int rc = kExitOk;
  auto l = ReadLetter(conn, g, seq, &rc);
  if (!l) return rc;
  if (!l->parsed) {
    return Fail(g, Error::FailedPrecondition(
                       gpuaas::reason::kDeadLetterMalformed,
                       fmt::format("sequence {} is not a gpuaas.v1.DeadLetter", seq)));
  }
  auto service = dlq::ReplayServiceOf(access::EmbeddedContract(), l->dl.stream(), l->dl.consumer());
  if (!service.ok()) return Fail(g, service.error());
  v1::ReplayDeadLetterRequest req;
  req.set_dlq_sequence(seq);
  auto r =
      client.Call<v1::ReplayDeadLetterResponse>(dlq::ReplaySubject(*service), req, g.Timeout());
  if (!r.ok()) return Fail(g, r.error());
  const auto outcome = r->outcome();
  Print(g, *r, [&] { PrintReplay(*r, *service, seq); });
  const bool done = outcome == v1::REPLAY_OUTCOME_APPLIED ||
                    outcome == v1::REPLAY_OUTCOME_DUPLICATE ||
                    outcome == v1::REPLAY_OUTCOME_REPUBLISHED;
  return done ? kExitOk : kExitOutcome;
}

// dlq replay: the owning service runs the consumer's handler on the dead letter again.
DlqAction AddDlqReplay(CLI::App& dlq_cmd) {
  auto* replay = dlq_cmd.add_subcommand(
      "replay",
      "Run the consumer's handler on it again, in the service that owns the consumer "
      "(idempotent); the dead letter stays until discarded");
  auto seq = AddSeqOption(*replay);
  return [replay, seq](messaging::Connection& conn, rpc::Client& client,
                       const Globals& g) -> std::optional<int> {
    if (!replay->parsed()) return std::nullopt;
    return RunDlqReplay(conn, client, g, *seq);
  };
}

// dlq discard --yes: deletes a dead letter for good.
DlqAction AddDlqDiscard(CLI::App& dlq_cmd) {
  auto* discard = dlq_cmd.add_subcommand("discard", "Delete a dead letter for good");
  auto seq = AddSeqOption(*discard);
  auto yes = std::make_shared<bool>(false);
  discard->add_flag("--yes", *yes, "Confirm: the dead letter cannot be recovered");
  return [discard, seq, yes](messaging::Connection& conn, rpc::Client& /*client*/,
                             const Globals& g) -> std::optional<int> {
    if (!discard->parsed()) return std::nullopt;
    // Read first, as show and replay do: an unknown sequence is that error, --yes or not.
    int rc = kExitOk;
    if (!ReadLetter(conn, g, *seq, &rc)) return rc;
    if (!*yes) {
      return Usage(g,
                   Error::InvalidArgument(
                       reason::kConfirmRequired,
                       fmt::format("discard deletes dead letter {} for good; pass --yes", *seq)));
    }
    if (auto r = dlq::Delete(conn, *seq); !r.ok()) return Fail(g, r.error());
    if (g.Json()) {
      json j;
      j["dlq_sequence"] = *seq;
      j["discarded"] = true;
      PrintJson(g, j);
    } else {
      std::cout << fmt::format("discarded dead letter {}\n", *seq);
    }
    return kExitOk;
  };
}

}  // namespace

DlqAction AddDlqCommands(CLI::App& app) {
  auto* dlq_cmd = app.add_subcommand(
      "dlq", "Dead letters: what a consumer gave up on (list, show, replay, discard)");
  dlq_cmd->require_subcommand(1);
  return FirstOf<DlqAction>({AddDlqList(*dlq_cmd), AddDlqShow(*dlq_cmd), AddDlqReplay(*dlq_cmd),
                             AddDlqDiscard(*dlq_cmd)});
}

}  // namespace gpuaas::ctl
