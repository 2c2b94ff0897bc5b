// http/cancel.h: a one-shot cancellation signal (client disconnect -> close the upstream call).
//
// fire() runs every subscribed callback once, in the firing thread, outside the lock; a callback
// subscribed after the fire runs at once. In the server, the signal of a request fires on that
// connection's strand, and client calls made from the handler subscribe from the same strand, so
// callbacks may touch that call's socket safely.
// Thread-safety: all members are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace lorasync::http {

class CancelSignal {
 public:
  using Id = std::uint64_t;

  bool fired() const {
    std::lock_guard lk(mu_);
    return fired_;
  }
  void fire() {
    Slot first[kInline];
    std::vector<Slot> more;
    {
      std::lock_guard lk(mu_);
      if (fired_) return;
      fired_ = true;
      for (int i = 0; i < kInline; ++i) first[i] = std::move(inline_[i]);
      more.swap(more_);
    }
    for (auto& s : first)
      if (s.id != 0) s.f();
    for (auto& s : more) s.f();
  }
  Id subscribe(std::function<void()> f) {
    {
      std::lock_guard lk(mu_);
      if (!fired_) {
        const Id id = ++next_;
        for (auto& s : inline_)
          if (s.id == 0) {
            s.id = id;
            s.f = std::move(f);
            return id;
          }
        more_.push_back(Slot{id, std::move(f)});
        return id;
      }
    }
    f();
    return 0;
  }
  void unsubscribe(Id id) {
    if (id == 0) return;
    std::lock_guard lk(mu_);
    for (auto& s : inline_)
      if (s.id == id) {
        s.id = 0;
        s.f = nullptr;
        return;
      }
    for (auto it = more_.begin(); it != more_.end(); ++it)
      if (it->id == id) {
        more_.erase(it);
        return;
      }
  }

 private:
  // The first subscriptions live inline (a request has one or two: its upstream call, a wait for
  // a connection), so subscribing allocates nothing; more go to a vector. id 0: a free slot.
  struct Slot {
    Id id = 0;
    std::function<void()> f;
  };
  static constexpr int kInline = 2;
  mutable std::mutex mu_;
  bool fired_ = false;
  Id next_ = 0;
  Slot inline_[kInline];
  std::vector<Slot> more_;
};

}  // namespace lorasync::http
