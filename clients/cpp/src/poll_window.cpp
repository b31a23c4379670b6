#include "inferd/poll_window.hpp"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <string>

namespace inferd {
namespace {

// The moving average of the sleeps' lateness moves 1 / kGain of the way; the
// window opens at the kQuantile / kSteps quantile of the arrivals.
constexpr std::int64_t kGain = 4;
constexpr std::int64_t kQuantile = 1;
constexpr std::int64_t kSteps = 4;

std::int64_t ns_since(std::chrono::steady_clock::time_point from,
                      std::chrono::steady_clock::time_point to) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
}

bool ppoll_ready(int fd, std::int64_t timeout_ns) {
    pollfd readable{fd, POLLIN, 0};
    // After a signal, only the time left: glibc's ppoll leaves its timeout as it
    // was, and a sleep begun again in full never ended under a timer faster than it.
    auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
    int ready;
    do {
        auto left = std::max<std::int64_t>(0, ns_since(std::chrono::steady_clock::now(), until));
        timespec timeout{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
        ready = ppoll(&readable, 1, &timeout, nullptr);
    } while (ready < 0 && errno == EINTR);
    return ready > 0;
}

bool on_one_cpu_alone() {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    return sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) < 2;
}

}  // namespace

void Arrivals::observed(std::int64_t after_ns, std::int64_t width_ns) {
    if (opens_ns == 0) opens_ns = std::max<std::int64_t>(after_ns - width_ns, 1);
}

PollWindow::PollWindow(int width_us, Ready ready)
    : width_ns_(static_cast<std::int64_t>(width_us) * 1000),
      ready_(ready ? std::move(ready) : Ready(ppoll_ready)) {
    if (width_us < 0 || width_us > kMaxWidthUs) {
        throw std::invalid_argument("reply_spin_us must be 0.." + std::to_string(kMaxWidthUs) +
                                    ", got " + std::to_string(width_us));
    }
}

PollWindowStatus PollWindow::status() const {
    return {static_cast<int>(width_ns_ / 1000), caught_, early_, missed_,
            static_cast<std::uint64_t>(spent_ns_ / 1000)};
}

bool PollWindow::wait(int fd, Arrivals& arrivals, std::chrono::steady_clock::time_point sent,
                      std::chrono::steady_clock::time_point give_up_at) {
    if (width_ns_ == 0 || arrivals.opens_ns == 0 || on_one_cpu_alone()) return false;
    using clock = std::chrono::steady_clock;
    auto opens = std::min(sent + std::chrono::nanoseconds(arrivals.opens_ns - late_wake_ns_),
                          give_up_at);
    auto now = clock::now();
    if (opens > now) {
        bool ready = ready_(fd, ns_since(now, opens));
        now = clock::now();
        if (ready) return early(arrivals, ns_since(sent, now));
        late_wake_ns_ += (std::max<std::int64_t>(0, ns_since(opens, now)) - late_wake_ns_) / kGain;
    }
    auto started = now;
    auto closes = std::min(started + std::chrono::nanoseconds(width_ns_), give_up_at);
    bool ready = false;
    int polls = 0;
    while (true) {
        ready = ready_(fd, 0);
        ++polls;
        now = clock::now();
        if (ready || now >= closes) break;
    }
    spent_ns_ += ns_since(started, now);
    if (ready && polls == 1) return early(arrivals, ns_since(sent, now));  // came while the sleep overshot
    // The reply came after the window opened, or not in it: open it later.
    arrivals.opens_ns += width_ns_ * kQuantile / kSteps;
    if (ready) {
        ++caught_;
        return true;
    }
    ++missed_;
    return false;
}

bool PollWindow::early(Arrivals& arrivals, std::int64_t arrived_ns) {
    auto step = width_ns_ * (kSteps - kQuantile) / kSteps;
    arrivals.opens_ns =
        std::max<std::int64_t>(1, std::min(arrivals.opens_ns - step, arrived_ns - width_ns_ / 2));
    ++early_;
    return true;
}

}  // namespace inferd
