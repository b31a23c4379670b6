// Events from the daemon's PUB socket, decoded into plain structs.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "inferd/endpoints.hpp"
#include "inferd/wire.hpp"

namespace zmq {
class context_t;
}

namespace inferd {

struct EventStamp {
    std::uint64_t ts_ns = 0;  // wall clock at publication
    std::uint64_t seq = 0;    // publisher sequence: a gap means missed events
};

struct ModelHealth {
    std::string state;
    std::optional<std::string> runtime;
    bool fallback = false;
    std::uint64_t queue_depth = 0;
};

// The health op's result and the body of a health event (health_snapshot).
struct HealthSnapshot {
    std::string state;  // starting, serving, degraded, stopping
    double uptime_s = 0;
    bool engine_worker_alive = false;
    bool bus_alive = false;
    bool publisher_alive = false;
    std::map<std::string, ModelHealth> models;
    wire::ThermalSummary thermal = wire::ThermalSummary::Unknown;
};

struct HealthEvent {
    EventStamp stamp;
    HealthSnapshot health;
};

// Where a model runs (model_runtime): a runtime event.
struct RuntimeEvent {
    EventStamp stamp;
    std::string model;
    std::string state;
    std::string configured_runtime;
    std::optional<std::string> runtime;
    bool fallback = false;
    std::vector<std::string> active_providers;
    std::vector<std::string> requested_providers;
    std::optional<std::string> provider_degradation;
    std::optional<std::string> engine_cache_error;
    std::optional<std::string> reason;
};

struct AlertEvent {
    EventStamp stamp;
    std::string level;  // syslog severity name
    std::string code;
    std::string message;
    std::string fields_json;  // keys depend on code (event_alert.json)
};

struct ThermalEvent {
    EventStamp stamp;
    std::optional<std::string> source;  // jtop, nvml, sysfs
    bool available = false;
    bool throttle_active = false;
    std::optional<double> cpu_temp_c;
    std::optional<double> gpu_temp_c;
    std::optional<double> clock_mhz;
    std::uint64_t measured_at_ns = 0;
    bool transition = false;  // throttling started or stopped at this poll
};

struct BuildEvent {
    EventStamp stamp;
    std::string build_id;
    std::uint64_t event_seq = 0;
    std::string type;  // phase_start, step, ..., completed, failed
    std::optional<std::string> phase_id;
    std::optional<std::string> parent_id;
    std::optional<std::string> name;
    std::optional<std::uint64_t> step;
    std::optional<std::uint64_t> num_steps;
    std::uint64_t monotonic_ns = 0;
    std::uint64_t wall_ns = 0;
    std::string thread;
    std::string cancel_state;
    std::string detail_json;
    // detail.timingCacheMode, one of the schema's words: on the terminal event what
    // the build did with its host's timing cache (cold, reused, updated, discarded,
    // quarantined, unknown); on the build's first event (as a rule its first
    // phase_start) the decision it started with (cold, reused, quarantined).
    // nullopt when the event has none, or null (not known).
    std::optional<std::string> timing_cache_mode;
    std::string model;
    std::string builder;
    bool simulated = false;
    std::uint64_t coalesced_steps = 0;
};

using Event = std::variant<HealthEvent, RuntimeEvent, AlertEvent, ThermalEvent, BuildEvent>;

// The payload of an event on `topic`; MalformedReply when it breaks its schema
// or the topic is not one of the five.
Event decode_event(const std::string& topic, const void* payload, std::size_t size);
std::string event_topic(const Event& event);

// `topic` when the daemon applies a subscription to it: one of the five topics'
// names, a prefix of one, or "" for every topic (inferd_wire/topics.py holds the
// same list). Otherwise std::invalid_argument naming the topics: the daemon
// closes every events connection of a subscriber that sends any other
// subscription (docs/PROTOCOL.md), so the client refuses it before connecting.
const std::string& check_topic(const std::string& topic);

// The largest event payload the subscriber takes: a reply header's bound, since
// the daemon's events carry what its control replies do (health, a build's state).
constexpr std::size_t kMaxEventBytes = wire::kMaxHeaderBytes;
// The subscriber's ZMQ_MAXMSGSIZE: libzmq checks each frame's length as it
// arrives, before it reads the body, and ends the connection of a longer one;
// without it an event of any size was taken whole into memory before decoding
// refused it. Each frame is bounded (the topic's is shorter); over CURVE a frame
// travels in a MESSAGE command 33 bytes longer (a 64 KiB payload needs 65569).
constexpr std::size_t kMaxEventFrameBytes = kMaxEventBytes + 33;

struct SubscriberOptions {
    std::string endpoint;              // empty: default_endpoints().events
    std::vector<std::string> topics;   // empty: every topic; each one check_topic's
    std::shared_ptr<zmq::context_t> context;  // null: the library's shared context
    std::optional<ClientCurve> curve;  // for a tcp:// endpoint of a daemon with security.curve
};

// A SUB socket on the events endpoint. PUB/SUB joins asynchronously (ZeroMQ's
// slow joiner): wait_joined() blocks until the first health event proves the
// subscription reached the daemon, keeping events of the subscribed topics
// that came before it.
//
// An event frame longer than kMaxEventFrameBytes ends the connection in libzmq
// as its length arrives, which libzmq then never makes again: the subscriber
// connects again itself. connections_lost() counts connections that ended once
// up (the daemon stopped, or such a frame); what the daemon published until the
// subscriber was back is lost, as for a late joiner. A payload longer than
// kMaxEventBytes is a MalformedReply.
//
// A connection the daemon refuses at its handshake (its access policy, or
// bus.max_connections), which libzmq never makes again, fails the wait_joined()
// or receive() that waits at once with ConnectionRefused (status(): the ZAP
// code) instead of a wait until the timeout. A refusal of the connection the
// constructor made, met before the first wait_joined() or receive(), which no
// receive waited on (the daemon was full then, and may have room since), throws
// nothing, as for a call on the request channel: that one connects anew and
// waits for that connection within its timeout. A refusal that came after a
// receive returned (one with a timeout of 0, say) fails the next one, unless a
// later handshake of the socket succeeded. The wait_joined() or receive() after
// a throw connects anew.
class EventSubscriber {
public:
    // Throws std::invalid_argument for a topic check_topic refuses.
    explicit EventSubscriber(SubscriberOptions options = {});
    ~EventSubscriber();
    EventSubscriber(const EventSubscriber&) = delete;
    EventSubscriber& operator=(const EventSubscriber&) = delete;

    // Throws ClientError when no health event arrives within timeout, and
    // ConnectionRefused at once when the daemon refuses the connection.
    void wait_joined(std::chrono::milliseconds timeout);
    // The next event of the subscribed topics, or nullopt after timeout;
    // ConnectionRefused when the daemon refused the connection (see above).
    std::optional<Event> receive(std::chrono::milliseconds timeout);
    // Connections to the daemon that ended once up (see the class's comment).
    std::uint64_t connections_lost() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace inferd
