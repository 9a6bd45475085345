// Environment switches (KESTREL_...), read where they apply; the callers keep the value in a
// function-local static, so each is read once per process.
#pragma once
#include <cstdlib>

namespace kestrel {

// On unless the variable is set to a number that is 0 (the A/B switches: NAME=0 turns a path off).
inline bool env_switch(const char* name) {
  const char* e = std::getenv(name);
  return !e || std::atoi(e) != 0;
}

// The variable as an integer, or `fallback` when it is not set.
inline int env_int(const char* name, int fallback) {
  const char* e = std::getenv(name);
  return e ? std::atoi(e) : fallback;
}

}  // namespace kestrel
