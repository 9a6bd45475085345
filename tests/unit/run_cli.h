// Runs the kestrel binary and captures its exit status and output.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace kestrel::test {

struct CliResult {
  int status = -1;
  std::string output;  // stdout and stderr together
};

inline CliResult run_kestrel(const std::string& args) {
  CliResult r;
  const std::string cmd = std::string(KESTREL_BINARY) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

}  // namespace kestrel::test
