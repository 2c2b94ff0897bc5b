// http::CancelSignal: every callback subscribed and not withdrawn runs once when it fires (the
// first ones are held inline, the rest in a vector); one subscribed after the fire runs at once.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "http/cancel.h"

namespace lorasync::http {
namespace {

TEST(CancelSignal, EveryCallbackStillSubscribedRunsOnceInlineOrNot) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    CancelSignal sig;
    const int n = static_cast<int>(rng() % 7);
    std::vector<int> runs(static_cast<std::size_t>(n), 0);
    std::vector<CancelSignal::Id> ids;
    for (int i = 0; i < n; ++i) ids.push_back(sig.subscribe([&runs, i] { ++runs[static_cast<std::size_t>(i)]; }));
    std::vector<bool> kept(static_cast<std::size_t>(n), true);
    for (int i = 0; i < n; ++i)
      if (rng() % 2) {
        sig.unsubscribe(ids[static_cast<std::size_t>(i)]);
        kept[static_cast<std::size_t>(i)] = false;
      }
    // A freed inline slot is reused by a later subscription.
    int late = 0;
    sig.subscribe([&late] { ++late; });
    EXPECT_FALSE(sig.fired());
    sig.fire();
    sig.fire();  // once only
    EXPECT_TRUE(sig.fired());
    for (int i = 0; i < n; ++i) EXPECT_EQ(runs[static_cast<std::size_t>(i)], kept[static_cast<std::size_t>(i)] ? 1 : 0);
    EXPECT_EQ(late, 1);
    int after = 0;
    EXPECT_EQ(sig.subscribe([&after] { ++after; }), 0u);
    EXPECT_EQ(after, 1);
    sig.unsubscribe(0);
  }
}

}  // namespace
}  // namespace lorasync::http
