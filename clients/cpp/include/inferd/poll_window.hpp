// Waiting for a reply that is due: asleep until shortly before it, then polling
// without sleeping for a bounded window (hybrid polling; DESIGN.md 113). The
// same rules as the Python client's inferd_client/poll_window.py:
//
// - per kind of request an Arrivals learns when the window opens, counted from
//   the send: a quarter-quantile of the replies' arrivals (a reply before the
//   window opens it 3/4 of a window earlier, at once to that arrival when
//   replies came sooner; any other reply, and an empty window, 1/4 later); the
//   first reply, read by a blocking wait, places the first window;
// - per connection a PollWindow learns how late a timed sleep ends (timer slack
//   and the wake-up) and asks for that much less; it sleeps in ppoll(2) (ended
//   early by the reply itself), then polls with a zero timeout until the reply
//   is there or the window has passed, never past the caller's deadline;
// - a width of 0 turns it off, as does a calling thread the kernel may run on
//   one CPU alone (its wake-up and polling would take the daemon's run's CPU).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

namespace inferd {

struct Arrivals {
    std::int64_t opens_ns = 0;  // 0: nothing learned yet

    // The first reply, read by a blocking wait `after_ns` after its send.
    void observed(std::int64_t after_ns, std::int64_t width_ns);
};

// What a window costs and buys (named like the daemon's busy poll's counters).
struct PollWindowStatus {
    int us = 0;
    std::uint64_t caught = 0;   // replies caught in the window
    std::uint64_t early = 0;    // replies there before it opened
    std::uint64_t missed = 0;   // windows that ended empty
    std::uint64_t spent_us = 0; // time spent polling
};

class PollWindow {
public:
    // Whether `fd` became readable within `timeout_ns` (0: poll, no wait).
    using Ready = std::function<bool(int fd, std::int64_t timeout_ns)>;
    static constexpr int kMaxWidthUs = 10000;

    // Throws std::invalid_argument outside 0..kMaxWidthUs; `ready` for tests.
    explicit PollWindow(int width_us, Ready ready = {});

    // Wait for `fd` around the time `arrivals` says the reply to the message sent
    // at `sent` is due: true when it is readable (read it now), false when the
    // caller is to wait as usual (off, nothing learned, or the window ended empty).
    bool wait(int fd, Arrivals& arrivals, std::chrono::steady_clock::time_point sent,
              std::chrono::steady_clock::time_point give_up_at);

    std::int64_t width_ns() const { return width_ns_; }
    std::int64_t late_wake_ns() const { return late_wake_ns_; }
    PollWindowStatus status() const;

private:
    bool early(Arrivals& arrivals, std::int64_t arrived_ns);
    std::int64_t width_ns_;
    Ready ready_;
    std::int64_t late_wake_ns_ = 0;
    std::uint64_t caught_ = 0, early_ = 0, missed_ = 0;
    std::int64_t spent_ns_ = 0;
};

}  // namespace inferd
