// commux::Error as data: the fields, and the messages composed from them (no network).
#include <gtest/gtest.h>

#include <string>

#include "commux/communicator.hpp"
#include "commux/error.hpp"

using namespace commux;

namespace {
bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
}  // namespace

TEST(Error, FieldsAndComposedMessage) {
  const Error e(Errc::kTimeout, ErrorSite{"irecv", 0, 77, 1024, "3"},
                "Timed out after 300 ms (from peer 0, tag 77, 1024 bytes, group 3, rank 1 of 2)");
  EXPECT_EQ(e.code(), Errc::kTimeout);
  EXPECT_EQ(e.op(), "irecv");
  ASSERT_TRUE(e.peer().has_value());
  EXPECT_EQ(*e.peer(), 0);
  ASSERT_TRUE(e.tag().has_value());
  EXPECT_EQ(*e.tag(), 77u);
  ASSERT_TRUE(e.bytes().has_value());
  EXPECT_EQ(*e.bytes(), 1024u);
  EXPECT_EQ(e.group(), "3");
  EXPECT_FALSE(e.still_posted());
  EXPECT_EQ(
      std::string(e.what()),
      "commux irecv: Timed out after 300 ms (from peer 0, tag 77, 1024 bytes, group 3, rank 1 "
      "of 2)");
  EXPECT_EQ(e.describe(), "irecv: " + e.reason());
}

TEST(Error, StillPostedIsAFieldAndItsNote) {
  const Error e(Errc::kTimeout, ErrorSite{"isend", 1, 5, 8, "0"}, "Timed out after 10 ms");
  const Error posted = e.with_still_posted(true);
  EXPECT_TRUE(posted.still_posted());
  EXPECT_EQ(std::string(posted.what()),
            "commux isend: Timed out after 10 ms; the operation is still posted: wait again or "
            "cancel it");
  // The fields and the reason are those of the original: the note is not part of the reason.
  EXPECT_EQ(posted.reason(), "Timed out after 10 ms");
  EXPECT_EQ(posted.op(), "isend");
  EXPECT_EQ(*posted.peer(), 1);
  const Error again = posted.with_still_posted(false);
  EXPECT_FALSE(again.still_posted());
  EXPECT_EQ(std::string(again.what()), "commux isend: Timed out after 10 ms");
}

// What a collective does with a timed-out receive (Exchange::rethrow): it names itself, keeps the
// receive's fields and is no longer posted. The composed message never carries the inner note,
// whatever its text is: before, the collective stripped the literal note from what().
TEST(Error, WrappingKeepsFieldsAndDropsTheNote) {
  const Error inner =
      Error(Errc::kTimeout, ErrorSite{"irecv", 2, 7, 64, "1"}, "Timed out after 5 ms")
          .with_still_posted(true);
  ErrorSite site = inner.site();
  site.op = "allreduce";
  const Error outer(inner.code(), site, inner.describe() + " [ring reduce-scatter]");
  EXPECT_EQ(std::string(outer.what()),
            "commux allreduce: irecv: Timed out after 5 ms [ring reduce-scatter]");
  EXPECT_FALSE(has(outer.what(), "still posted"));
  EXPECT_FALSE(outer.still_posted());
  EXPECT_EQ(*outer.peer(), 2);
  EXPECT_EQ(*outer.tag(), 7u);
  EXPECT_EQ(*outer.bytes(), 64u);
  EXPECT_EQ(outer.group(), "1");
}

TEST(Error, WholeMessageHasNoFields) {
  const Error e(Errc::kInvalidArgument, "commux init: no store given");
  EXPECT_EQ(std::string(e.what()), "commux init: no store given");
  EXPECT_EQ(e.reason(), "commux init: no store given");
  EXPECT_TRUE(e.op().empty());
  EXPECT_FALSE(e.peer().has_value());
  EXPECT_FALSE(e.tag().has_value());
  EXPECT_FALSE(e.bytes().has_value());
  EXPECT_TRUE(e.group().empty());
  EXPECT_EQ(e.describe(), e.reason());
  // Marking it posted adds the note without reading the text.
  EXPECT_EQ(std::string(e.with_still_posted(true).what()),
            std::string("commux init: no store given") + Error::kStillPostedNote);
}

TEST(Error, EmptyRequestNamesTheRequest) {
  Request r;
  try {
    r.wait();
    FAIL() << "an empty Request waited";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_EQ(e.op(), "request");
    EXPECT_EQ(std::string(e.what()), "commux request: empty Request");
    EXPECT_FALSE(e.still_posted());
  }
}

// A wait made in slices says how long it waited in all: the figure of "Timed out after N ms" is
// replaced, at the start only unless `anywhere`, and nothing else is touched.
TEST(Error, WithWaitLengthReplacesOnlyTheTimeoutFigure) {
  EXPECT_EQ(commux::with_wait_length("Timed out after 8 ms (to peer 1)", 300),
            "Timed out after 300 ms (to peer 1)");
  EXPECT_EQ(commux::with_wait_length("recv: Timed out after 8 ms", 300),
            "recv: Timed out after 8 ms");
  EXPECT_EQ(commux::with_wait_length("recv: Timed out after 8 ms", 300, true),
            "recv: Timed out after 300 ms");
  EXPECT_EQ(commux::with_wait_length("peer 1 is gone", 300, true), "peer 1 is gone");
}
