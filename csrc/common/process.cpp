#include "common/process.h"

#include <signal.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace kvcached {

namespace {
struct StatFields {
  char state = '?';
  std::uint64_t start_time = 0;
};

// Fields 3 (state) and 22 (start time) of /proc/PID/stat; state '?' when the process is gone.
StatFields read_stat(int pid) {
  StatFields out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name (field 2) may hold spaces and parentheses: fields restart after the last ')'.
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return out;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return StatFields{};
    if (i == 3) out.state = field[0];
  }
  out.start_time = std::strtoull(field.c_str(), nullptr, 10);
  return out;
}
}  // namespace

std::uint64_t process_start_time(int pid) { return read_stat(pid).start_time; }

bool process_alive(int pid, std::uint64_t start_time) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno != EPERM) return false;
  const StatFields stat = read_stat(pid);
  // A zombie (killed, not yet reaped by its parent) has already given its memory back.
  if (stat.state == 'Z' || stat.state == 'X' || stat.state == '?') return false;
  return start_time == 0 || stat.start_time == start_time;
}

}  // namespace kvcached
