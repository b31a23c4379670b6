// The connection to the daemon's shm.sock (internal): registrations, and infer
// requests whose tensors all live in registered regions (DESIGN.md 104, 108).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "inferd/client.hpp"
#include "inferd/poll_window.hpp"
#include "inferd/region.hpp"
#include "inferd/wire.hpp"

namespace inferd {

// The daemon keeps a region mapped while the connection that registered it is
// open: closing this releases every region it registered.
class RegionChannel {
public:
    // `next_id` numbers every message sent here: the client's one counter, so no
    // id is ever both a registration's and an infer request's. `connect_timeout`:
    // the most connect(2) waits for a listener whose backlog is full (unset:
    // `timeout`, the default of every call on the channel).
    RegionChannel(const std::string& path, std::chrono::milliseconds timeout, int reply_spin_us,
                  std::function<std::uint64_t()> next_id,
                  std::optional<std::chrono::milliseconds> connect_timeout = {});
    ~RegionChannel();
    RegionChannel(const RegionChannel&) = delete;
    RegionChannel& operator=(const RegionChannel&) = delete;

    // `timeout`: the most the registration waits (unset: the channel's). A
    // registration of `region` that timed out here and that the daemon made late
    // is this one: its late reply, read first without waiting, names the id and
    // nothing is sent (sent again, the region would be held twice, the second
    // copy counted against the daemon's bounds and refused for the first's
    // bytes). One that comes while this waits is taken too: over this one's
    // refusal or timeout, or in place of a second copy.
    std::string register_region(const std::shared_ptr<const detail::RegionMapping>& region,
                                std::optional<std::chrono::milliseconds> timeout = {});
    void unregister_region(const std::string& region_id);
    // Unregisters without waiting for the answer (discarded when it comes): for a
    // region destroyed while registered, and one a late registration reply names.
    void release(const std::string& region_id);

    // An infer request of `model`: each attempt sends `encode(id)` under a fresh id
    // (after `on_attempt(id, attempt)`, when set) and waits up to `timeout`,
    // polling in the model's window; returns the reply header. Throws Timeout
    // after `retries` resends, ClientError (nothing sent) for a message over
    // wire::kMaxShmMessageBytes.
    std::string request(const std::string& model,
                        const std::function<std::string(std::uint64_t)>& encode,
                        const std::function<void(std::uint64_t, int)>& on_attempt,
                        std::chrono::milliseconds timeout, int retries);

    // Whether the daemon closed the connection (a restart), refused it at connect
    // (and closes it), or it failed: the regions registered on it are released.
    // A poll that does not wait, for a call that has not used the connection.
    bool hung_up() const;

    // Replies to ids no longer waited for (attempts that timed out).
    std::uint64_t discarded_replies() const { return discarded_; }
    const PollWindow& spin() const { return spin_; }

private:
    using Clock = std::chrono::steady_clock;
    // A registration op; `region`: the region a "register" is for.
    std::string call(const std::string& op, const wire::ControlArguments& arguments, int fd,
                     std::optional<std::chrono::milliseconds> timeout = {},
                     std::weak_ptr<const detail::RegionMapping> region = {});
    // Sends one message, waiting for room until `give_up_at` at most; false when
    // the daemon did not take it by then (it does not read: a seqpacket message
    // goes whole or not at all). ClientError, and nothing sent, for one over
    // wire::kMaxShmMessageBytes: the daemon would refuse it unread, with id null.
    bool send_message(const std::string& message, int fd, Clock::time_point give_up_at);
    // The reply to `request_id` (or an error reply with id null: every message
    // sent is read whole, so that refusal, at connect, is the waiting call's), or
    // none by `give_up_at`; replies to other ids are discarded and counted.
    std::optional<std::string> await(std::uint64_t request_id, Clock::time_point give_up_at,
                                     bool ready = false);
    // The next message (`ready`: a poll just saw one), or none by `give_up_at`;
    // ClientError when the connection closed or failed.
    std::optional<std::string> next_message(Clock::time_point give_up_at, bool ready);
    // Reads the replies already here, without waiting (register_region): a late
    // registration's is adopted or its region released (discard) before
    // anything else is sent, so the daemon never holds a region twice.
    void read_queued();
    // A reply to an id no longer waited for. The late success of a registration
    // that timed out is adopted when it is of the region register_region
    // registers now (adopted_), else the region it names is released (nobody
    // knows its id but this reply); any other is counted.
    void discard(const wire::RequestId& id, bool ok, const std::optional<std::string>& region);
    // Notes that the connection is done for; `what`, saying what follows.
    std::string failed(const std::string& what);
    std::string path_;
    bool refused_ = false;
    bool failed_ = false;
    std::chrono::milliseconds timeout_;
    int fd_ = -1;
    std::function<std::uint64_t()> next_id_;
    std::uint64_t discarded_ = 0;
    PollWindow spin_;
    std::map<std::string, Arrivals> arrivals_;  // by model: when its replies arrive
    // Registrations that timed out, with the region each was for: the daemon may
    // still make them, under a region id only their late reply names.
    std::map<std::uint64_t, std::weak_ptr<const detail::RegionMapping>> late_registrations_;
    // The region register_region registers now, and the id of a late
    // registration of it read meanwhile (discard).
    const detail::RegionMapping* registering_ = nullptr;
    std::optional<std::string> adopted_;
};

}  // namespace inferd
