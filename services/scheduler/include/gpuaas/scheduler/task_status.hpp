#pragma once
// Where a node task the scheduler sent stands (allocation_tasks.status). Not on the wire, so a
// C++ enum whose column texts are here; saga_store.cpp converts where rows are read and written.
// The column's CHECK constraint (migrations/0004_saga.sql) admits exactly kTaskStatusTexts'
// texts (tests/contract/enum_checks_test.cpp compares them).
#include <array>
#include <optional>
#include <string_view>

namespace gpuaas::scheduler {

enum class TaskStatus {
  kSent,       // sent, not answered yet (the only open status)
  kSucceeded,  // the node's result said succeeded
  kFailed,     // ... failed
  kRejected,   // ... rejected (the node refused the spec)
  kTimedOut,   // its deadline passed first (node_unresponsive)
  kCancelled,  // still open when a transition cancelled its allocation's tasks
};

struct TaskStatusEntry {
  TaskStatus status;
  std::string_view text;
};

inline constexpr std::array<TaskStatusEntry, 6> kTaskStatusTexts = {{
    {TaskStatus::kSent, "sent"},
    {TaskStatus::kSucceeded, "succeeded"},
    {TaskStatus::kFailed, "failed"},
    {TaskStatus::kRejected, "rejected"},
    {TaskStatus::kTimedOut, "timed_out"},
    {TaskStatus::kCancelled, "cancelled"},
}};

// The column text of `s`.
constexpr std::string_view TaskStatusText(TaskStatus s) {
  for (const auto& e : kTaskStatusTexts) {
    if (e.status == s) return e.text;
  }
  return {};
}

// The status a column text names; nullopt for a text this build does not know.
constexpr std::optional<TaskStatus> ParseTaskStatus(std::string_view text) {
  for (const auto& e : kTaskStatusTexts) {
    if (e.text == text) return e.status;
  }
  return std::nullopt;
}

}  // namespace gpuaas::scheduler
