// The incremental server-sent events parser: every split of a stream gives the events of the
// whole, with LF, CRLF and CR line ends, multi-line data, comments, [DONE], fields without a space.
#include <gtest/gtest.h>

#include "client/sse.h"
#include "common/error.h"

namespace kestrel::client {
namespace {

std::vector<SseEvent> parse_in_parts(std::string_view s, std::vector<size_t> cuts) {
  SseParser p;
  std::vector<SseEvent> out;
  size_t at = 0;
  cuts.push_back(s.size());
  for (size_t c : cuts) {
    p.feed(s.substr(at, c - at), out);
    at = c;
  }
  EXPECT_FALSE(p.partial());
  return out;
}

std::string with_line_ends(std::string s, const std::string& eol) {
  std::string out;
  for (char ch : s) out += ch == '\n' ? eol : std::string(1, ch);
  return out;
}

// An OpenAI-style stream with a comment (keep-alive), a multi-line event, an event type and id,
// a field without the space after the colon, an empty data line and [DONE].
const char* kStream =
    ": keep-alive\n"
    "\n"
    "data: {\"choices\":[{\"text\":\"Hello\"}]}\n"
    "\n"
    "data: line one\n"
    "data: line two\n"
    "\n"
    ": ping\n"
    "event: update\n"
    "id: 7\n"
    "data:no space\n"
    "\n"
    "data\n"
    "\n"
    "data:  two spaces\n"
    "retry: 100\n"
    "unknown field\n"
    "\n"
    "data: [DONE]\n"
    "\n";

const std::vector<SseEvent> kExpected = {
    {"", "{\"choices\":[{\"text\":\"Hello\"}]}", ""},
    {"", "line one\nline two", ""},
    {"update", "no space", "7"},
    {"", "", "7"},             // "data" alone: one empty data line; the id stays
    {"", " two spaces", "7"},  // only the first space after the colon goes
    {"", "[DONE]", "7"},
};

TEST(Sse, WholeStreamWithEachLineEnd) {
  for (const char* eol : {"\n", "\r\n", "\r"}) {
    SseParser p;
    const std::vector<SseEvent> got = p.feed(with_line_ends(kStream, eol));
    EXPECT_EQ(got, kExpected) << "line end " << (eol[0] == '\r' ? (eol[1] ? "CRLF" : "CR") : "LF");
    EXPECT_EQ(p.comments(), 2u);
    EXPECT_FALSE(p.partial());
  }
}

TEST(Sse, EverySplitPositionGivesTheSameEvents) {
  for (const char* eol : {"\n", "\r\n", "\r"}) {
    const std::string s = with_line_ends(kStream, eol);
    for (size_t i = 0; i <= s.size(); ++i) {
      ASSERT_EQ(parse_in_parts(s, {i}), kExpected) << "split at " << i << " of " << s.size();
      for (size_t j = i; j <= s.size(); j += 7) ASSERT_EQ(parse_in_parts(s, {i, j}), kExpected) << "splits " << i << ", " << j;
    }
    std::vector<size_t> every_byte;
    for (size_t i = 1; i < s.size(); ++i) every_byte.push_back(i);
    EXPECT_EQ(parse_in_parts(s, every_byte), kExpected);
  }
}

TEST(Sse, CrlfSplitBetweenCrAndLfIsOneLineEnd) {
  SseParser p;
  EXPECT_TRUE(p.feed("data: a\r").empty());
  EXPECT_TRUE(p.feed("\n").empty());  // the LF of that CRLF, not a blank line
  const auto got = p.feed("\r\n");    // the blank line
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].data, "a");
}

TEST(Sse, EventsArriveWhenTheirBlankLineDoes) {
  SseParser p;
  EXPECT_TRUE(p.feed("data: a\n").empty());
  EXPECT_TRUE(p.partial());
  const auto got = p.feed("\ndata: b");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].data, "a");
  EXPECT_TRUE(p.partial());  // "data: b" waits for its line end and blank line
  EXPECT_TRUE(p.feed("\n").empty());
  ASSERT_EQ(p.feed("\n").size(), 1u);
  EXPECT_FALSE(p.partial());
}

TEST(Sse, CommentsAndBlankLinesMakeNoEvents) {
  SseParser p;
  EXPECT_TRUE(p.feed(":\n\n: keep-alive\n\n\n\nevent: x\n\n").empty());
  EXPECT_EQ(p.comments(), 2u);
  // An event type without data is dropped with its (empty) event, so it does not carry over.
  const auto got = p.feed("data: y\n\n");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].event, "");
}

TEST(Sse, ByteOrderMarkAtTheStartIsSkipped) {
  const std::string s = "\xEF\xBB\xBF" "data: x\n\n";
  for (size_t i = 0; i <= s.size(); ++i) {
    const auto got = parse_in_parts(s, {i});
    ASSERT_EQ(got.size(), 1u) << i;
    EXPECT_EQ(got[0].data, "x");
  }
}

TEST(Sse, UnfinishedEventAtTheEndIsNotDelivered) {
  SseParser p;
  EXPECT_TRUE(p.feed("data: {\"choices\":[{\"te").empty());
  EXPECT_TRUE(p.partial());
}

TEST(Sse, OverlongLineOrEventThrows) {
  SseParser p(64);
  EXPECT_NO_THROW(p.feed("data: " + std::string(50, 'x') + "\n\n"));
  EXPECT_THROW(p.feed("data: " + std::string(100, 'x')), Error);
  SseParser q(64);
  EXPECT_THROW(
      {
        for (int i = 0; i < 20; ++i) q.feed("data: 0123456789\n");
      },
      Error);
}

}  // namespace
}  // namespace kestrel::client
