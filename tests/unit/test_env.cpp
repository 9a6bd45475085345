#include "common/env.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace kestrel {
namespace {

TEST(Env, SwitchIsOnUnlessZero) {
  const char* name = "KESTREL_TEST_ENV_SWITCH";
  unsetenv(name);
  EXPECT_TRUE(env_switch(name));
  setenv(name, "0", 1);
  EXPECT_FALSE(env_switch(name));
  setenv(name, "1", 1);
  EXPECT_TRUE(env_switch(name));
  setenv(name, "2", 1);
  EXPECT_TRUE(env_switch(name));
  unsetenv(name);
}

TEST(Env, IntFallsBackWhenUnset) {
  const char* name = "KESTREL_TEST_ENV_INT";
  unsetenv(name);
  EXPECT_EQ(env_int(name, 7), 7);
  setenv(name, "12", 1);
  EXPECT_EQ(env_int(name, 7), 12);
  setenv(name, "0", 1);
  EXPECT_EQ(env_int(name, 7), 0);
  unsetenv(name);
}

}  // namespace
}  // namespace kestrel
