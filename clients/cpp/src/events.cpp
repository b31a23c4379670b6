#include "inferd/events.hpp"

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <stdexcept>

#include "connection_watch.hpp"
#include "decode.hpp"
#include "inferd/client.hpp"
#include "inferd/endpoints.hpp"
#include "internal.hpp"

namespace inferd {
namespace {

using detail::Fields;

constexpr std::string_view kHealth = "health";
constexpr std::array<std::string_view, 5> kTopics{"alert", "build", "health", "runtime",
                                                  "thermal"};

EventStamp read_stamp(const Fields& payload) {
    EventStamp stamp;
    stamp.ts_ns = payload.uint("ts_ns");
    stamp.seq = payload.uint("seq");
    if (stamp.seq < 1) detail::malformed(payload.where() + ".seq must be at least 1");
    return stamp;
}

const std::vector<std::string_view> kRuntimeLabels{"tensorrt", "onnx_trt_ep"};

std::string one_of(const Fields& fields, std::string_view key,
                   std::initializer_list<std::string_view> allowed) {
    auto value = fields.string(key);
    for (auto candidate : allowed) {
        if (candidate == value) return value;
    }
    detail::malformed(fields.where() + "." + std::string(key) + " has an unknown value '" + value +
                      "'");
}

std::optional<std::string> nullable_one_of(const Fields& fields, std::string_view key,
                                           std::initializer_list<std::string_view> allowed) {
    if (fields.required(key).type == msgpack::type::NIL) return std::nullopt;
    return one_of(fields, key, allowed);
}

}  // namespace

namespace detail {

HealthSnapshot read_health(const Fields& fields, std::initializer_list<std::string_view> extra) {
    std::vector<std::string_view> known{"state", "uptime_s", "threads", "models", "thermal"};
    known.insert(known.end(), extra.begin(), extra.end());
    for (std::uint32_t i = 0; i < fields.object().via.map.size; ++i) {
        const auto& key = fields.object().via.map.ptr[i].key;
        std::string_view name(key.via.str.ptr, key.via.str.size);
        bool found = false;
        for (auto candidate : known) found = found || candidate == name;
        if (!found) malformed(fields.where() + " has an unknown key '" + std::string(name) + "'");
    }
    HealthSnapshot health;
    health.state = one_of(fields, "state", {"starting", "serving", "degraded", "stopping"});
    health.uptime_s = fields.number("uptime_s");
    auto threads = fields.map("threads");
    threads.only({"engine_worker", "bus", "publisher"});
    health.engine_worker_alive = threads.boolean("engine_worker");
    health.bus_alive = threads.boolean("bus");
    health.publisher_alive = threads.boolean("publisher");
    auto models = fields.map("models");
    for (std::uint32_t i = 0; i < models.object().via.map.size; ++i) {
        const auto& entry = models.object().via.map.ptr[i];
        auto name = as_string(entry.key, models.where());
        Fields model(entry.val, models.where() + "." + name);
        model.only({"state", "runtime", "fallback", "queue_depth"});
        ModelHealth item;
        item.state = one_of(model, "state", {"loading", "serving", "failed", "released"});
        item.runtime = nullable_one_of(model, "runtime", {"tensorrt", "onnx_trt_ep"});
        item.fallback = model.boolean("fallback");
        item.queue_depth = model.uint("queue_depth");
        health.models.emplace(name, item);
    }
    health.thermal = read_thermal_summary(fields.string("thermal"), fields.where() + ".thermal");
    return health;
}

}  // namespace detail

namespace {

RuntimeEvent read_runtime(const Fields& payload) {
    payload.only({"model", "state", "configured_runtime", "runtime", "fallback", "active_providers",
                  "requested_providers", "provider_degradation", "engine_cache_error", "reason",
                  "ts_ns", "seq"});
    RuntimeEvent event;
    event.stamp = read_stamp(payload);
    event.model = payload.string("model");
    event.state = one_of(payload, "state", {"loading", "serving", "failed", "released"});
    event.configured_runtime = one_of(payload, "configured_runtime", {"tensorrt", "onnx_trt_ep"});
    event.runtime = nullable_one_of(payload, "runtime", {"tensorrt", "onnx_trt_ep"});
    event.fallback = payload.boolean("fallback");
    event.active_providers = payload.strings("active_providers");
    event.requested_providers = payload.strings("requested_providers");
    event.provider_degradation = nullable_one_of(payload, "provider_degradation",
                                                 {"cpu_only", "no_tensorrt_ep", "no_cuda_ep"});
    event.engine_cache_error = payload.nullable_string("engine_cache_error");
    event.reason = payload.nullable_string("reason");
    return event;
}

AlertEvent read_alert(const Fields& payload) {
    payload.only({"level", "code", "message", "fields", "ts_ns", "seq"});
    AlertEvent event;
    event.stamp = read_stamp(payload);
    event.level = one_of(payload, "level",
                         {"EMERGENCY", "ALERT", "CRITICAL", "ERROR", "WARNING", "NOTICE", "INFO",
                          "DEBUG"});
    event.code = payload.string("code");
    event.message = payload.string("message");
    payload.map("fields");  // a map, whatever its keys
    event.fields_json = payload.json("fields");
    return event;
}

ThermalEvent read_thermal(const Fields& payload) {
    payload.only({"source", "available", "throttle_active", "cpu_temp_c", "gpu_temp_c",
                  "clock_mhz", "measured_at_ns", "transition", "ts_ns", "seq"});
    ThermalEvent event;
    event.stamp = read_stamp(payload);
    event.source = nullable_one_of(payload, "source", {"jtop", "nvml", "sysfs"});
    event.available = payload.boolean("available");
    event.throttle_active = payload.boolean("throttle_active");
    event.cpu_temp_c = payload.nullable_number("cpu_temp_c");
    event.gpu_temp_c = payload.nullable_number("gpu_temp_c");
    event.clock_mhz = payload.nullable_number("clock_mhz");
    event.measured_at_ns = payload.uint("measured_at_ns");
    event.transition = payload.boolean("transition");
    if (!event.available && event.throttle_active) {
        detail::malformed("thermal event: throttling reported without telemetry");
    }
    return event;
}

BuildEvent read_build(const Fields& payload) {
    payload.only({"buildId", "eventSeq", "type", "phaseId", "parentId", "name", "step", "numSteps",
                  "monotonicNs", "wallNs", "thread", "cancelState", "detail", "model", "builder",
                  "simulated", "coalescedSteps", "ts_ns", "seq"});
    BuildEvent event;
    event.stamp = read_stamp(payload);
    event.build_id = payload.string("buildId");
    event.event_seq = payload.uint("eventSeq");
    event.type = one_of(payload, "type",
                        {"phase_start", "step", "phase_finish", "stalled", "cancel_requested",
                         "cancelled", "completed", "failed"});
    event.phase_id = payload.nullable_string("phaseId");
    event.parent_id = payload.nullable_string("parentId");
    event.name = payload.nullable_string("name");
    event.step = payload.nullable_uint("step");
    event.num_steps = payload.nullable_uint("numSteps");
    event.monotonic_ns = payload.uint("monotonicNs");
    event.wall_ns = payload.uint("wallNs");
    event.thread = payload.string("thread");
    event.cancel_state =
        one_of(payload, "cancelState", {"none", "requested", "acknowledged", "cleaned_up", "too_late"});
    if (payload.find("detail") != nullptr) {
        auto detail = payload.map("detail");  // its other keys are free (event_build.json)
        if (detail.find("timingCacheMode") != nullptr) {
            event.timing_cache_mode =
                nullable_one_of(detail, "timingCacheMode",
                                {"cold", "reused", "updated", "discarded", "quarantined", "unknown"});
        }
        event.detail_json = payload.json("detail");
    }
    event.model = payload.string("model");
    event.builder = one_of(payload, "builder", {"tensorrt", "simulated"});
    event.simulated = payload.boolean("simulated");
    event.coalesced_steps = payload.uint("coalescedSteps");
    return event;
}

}  // namespace

Event decode_event(const std::string& topic, const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, std::numeric_limits<std::size_t>::max());
    Fields payload(handle.get(), topic + " event");
    if (topic == kHealth) {
        HealthEvent event;
        event.stamp = read_stamp(payload);
        event.health = detail::read_health(payload, {"ts_ns", "seq"});
        return event;
    }
    if (topic == "runtime") return read_runtime(payload);
    if (topic == "alert") return read_alert(payload);
    if (topic == "thermal") return read_thermal(payload);
    if (topic == "build") return read_build(payload);
    detail::malformed("unknown event topic '" + topic + "'");
}

std::string event_topic(const Event& event) {
    switch (event.index()) {
        case 0: return "health";
        case 1: return "runtime";
        case 2: return "alert";
        case 3: return "thermal";
        default: return "build";
    }
}

struct EventSubscriber::Impl {
    std::shared_ptr<zmq::context_t> context;
    zmq::socket_t socket;
    // The monitor of `socket` (declared after it: it stops before the socket closes).
    std::unique_ptr<detail::ConnectionWatch> watch;
    std::string endpoint;
    std::vector<std::string> topics;
    bool hide_health = false;  // subscribed to health only to detect the join
    // health is subscribed here to detect the join: once however often a join is
    // tried, since libzmq counts each subscription and the one unsubscription after
    // a join would leave the others in place (a join that threw had its own).
    bool health_subscribed = false;
    std::deque<Event> pending;
    std::uint64_t connections_lost = 0;
    // The socket is to be connected anew by the next read: a read threw the
    // daemon's refusal (and disconnected it), or the first read found a refusal of
    // the connection the constructor made, before it (which it does not throw).
    bool refused = false;
    // A read has begun: news read from then on concerns a connection that a read
    // made or waited on.
    bool read_began = false;

    // One [topic, payload] message, or nullopt once `give_up_at` has passed (a
    // message already there is read even then). ConnectionRefused when the daemon
    // refused the connection (see check_connection).
    std::optional<std::pair<std::string, Event>> read(
        std::chrono::steady_clock::time_point give_up_at) {
        if (!read_began) {
            // News already here came before any read: a refusal in it is of the
            // connection the constructor made, which no read waited on; the daemon
            // may have room by now, and its reason may be false. As the request
            // channel does for a call (DESIGN.md 325), it is forgotten and this read
            // connects anew, then waits for that connection.
            check_connection(false);
            read_began = true;
        }
        if (refused) {
            // A read threw the refusal and the socket was disconnected, or the first
            // read forgot one from before it: this one connects anew, and waits for
            // that connection.
            connect_anew();
            refused = false;
        }
        std::vector<zmq::message_t> parts;
        // Part by part: a signal handler's EINTR between the parts of an event
        // lost the parts read, and the next read took the payload for an event.
        while (!detail::recv_message(socket, parts)) {
            check_connection();
            // Rounded up, and measured again after each wait (a signal, the
            // monitor's news): never shorter than asked, nor longer.
            auto left = detail::milliseconds_left(give_up_at);
            if (left <= 0) return std::nullopt;
            detail::wait_either(socket, watch->monitor(), left);
        }
        if (parts.size() != 2) {
            detail::malformed("event has " + std::to_string(parts.size()) +
                              " frames; expected [topic, payload]");
        }
        if (parts[1].size() > kMaxEventBytes) {
            detail::malformed("event payload frame is " + std::to_string(parts[1].size()) +
                              " bytes; the limit is " + std::to_string(kMaxEventBytes));
        }
        auto topic = parts[0].to_string();
        return std::make_pair(topic, decode_event(topic, parts[1].data(), parts[1].size()));
    }

    // Reads the monitor's news and connects again when a connection that was up
    // ended and libzmq is not making it again: it does not after a protocol
    // error, such as a frame over ZMQ_MAXMSGSIZE, and the subscriber would wait
    // for good. After a disconnection libzmq retries at once (CONNECT_RETRIED
    // follows) where it will; when that news is not here yet, connecting again
    // anew does no harm: disconnect ends libzmq's attempt, so there is still one
    // connection. (A SUB loses nothing it would have sent in the meantime, unlike
    // the request channel, which makes its socket anew instead.)
    //
    // A handshake the daemon refused (its access policy, bus.max_connections),
    // read in this check and not outlived by a later one that succeeded, throws
    // ConnectionRefused: libzmq never connects a refused socket again, and the
    // read would wait until its timeout, or for good. The socket is disconnected
    // first (no tries of libzmq's while the caller makes room); the next read
    // connects anew. One that came after the last read returned (its connection)
    // is in the news the next read checks. With `waited` false (the first read's
    // look, before it waits) a refusal throws nothing: the read connects anew.
    void check_connection(bool waited = true) {
        auto news = watch->check();
        connections_lost += news.lost;
        if (news.refused && !waited) {
            refused = true;  // read() connects anew
            return;
        }
        if (news.refused) {
            detail::disconnect_from(socket, endpoint);
            refused = true;
            throw detail::refused_error(endpoint, *news.refused, "the next receive connects anew");
        }
        if (news.lost == 0 || news.retried) return;
        connect_anew();
    }

    // Connects again: disconnect first ends any attempt libzmq still makes, so
    // there is one connection at most.
    void connect_anew() {
        detail::disconnect_from(socket, endpoint);
        socket.connect(endpoint);
    }
};

const std::string& check_topic(const std::string& topic) {
    for (auto name : kTopics) {
        if (name.substr(0, topic.size()) == topic) return topic;
    }
    std::string known;
    for (auto name : kTopics) known += (known.empty() ? "" : ", ") + std::string(name);
    throw std::invalid_argument("unknown event topic '" + topic + "'; known: " + known +
                                " (or a prefix of one; none for every topic)");
}

EventSubscriber::EventSubscriber(SubscriberOptions options) : impl_(std::make_unique<Impl>()) {
    for (const auto& topic : options.topics) check_topic(topic);
    impl_->context = options.context ? options.context : shared_context();
    impl_->endpoint = check_client_endpoint(options.endpoint.empty() ? default_endpoints().events
                                                                     : options.endpoint);
    try {
        impl_->socket = zmq::socket_t(*impl_->context, zmq::socket_type::sub);
        impl_->socket.set(zmq::sockopt::linger, 0);
        impl_->socket.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(kMaxEventFrameBytes));
        // Before it connects, to see the first handshake.
        impl_->watch = std::make_unique<detail::ConnectionWatch>(*impl_->context, impl_->socket);
    } catch (const zmq::error_t& error) {  // EMFILE at the descriptor limit, say
        throw detail::socket_error(impl_->endpoint, error);
    }
    detail::secure(impl_->socket, impl_->endpoint, options.curve);
    impl_->topics = options.topics;
    if (options.topics.empty()) {
        impl_->socket.set(zmq::sockopt::subscribe, "");
    }
    for (const auto& topic : options.topics) impl_->socket.set(zmq::sockopt::subscribe, topic);
    try {
        impl_->socket.connect(impl_->endpoint);
    } catch (const zmq::error_t& error) {
        throw std::invalid_argument("cannot connect to " + impl_->endpoint + ": " + error.what());
    }
}

EventSubscriber::~EventSubscriber() = default;

void EventSubscriber::wait_joined(std::chrono::milliseconds timeout) {
    auto& self = *impl_;
    bool health_asked = self.topics.empty();
    // A prefix of "health" ("he", "") subscribes to it too: then nothing is hidden.
    for (const auto& topic : self.topics) {
        health_asked = health_asked || kHealth.substr(0, topic.size()) == topic;
    }
    if (!health_asked) {
        self.hide_health = true;
        if (!self.health_subscribed) {  // a join that threw left it subscribed
            self.socket.set(zmq::sockopt::subscribe, std::string(kHealth));
            self.health_subscribed = true;
        }
    }
    // Saturated: milliseconds::max() waits for ever, without overflowing.
    auto give_up_at = detail::deadline_after(timeout);
    // Not joined: the next connection would carry the hidden subscription, and each
    // read would take and drop a health event for nothing.
    auto unsubscribe_health = [&self]() noexcept {
        if (!self.health_subscribed) return;
        try {
            self.socket.set(zmq::sockopt::unsubscribe, std::string(kHealth));
        } catch (const zmq::error_t&) {  // a socket closed under it: nothing left to drop
        }
        self.health_subscribed = false;
    };
    try {
        while (true) {
            auto event = self.read(give_up_at);
            if (!event) {
                throw ClientError("no health event from " + self.endpoint + " within " +
                                  std::to_string(timeout.count()) +
                                  " ms: is the daemon running and publishing there?");
            }
            bool is_health = event->first == kHealth;
            if (!(is_health && self.hide_health)) self.pending.push_back(std::move(event->second));
            if (is_health) break;
        }
    } catch (...) {
        unsubscribe_health();
        throw;
    }
    unsubscribe_health();
}

std::optional<Event> EventSubscriber::receive(std::chrono::milliseconds timeout) {
    auto& self = *impl_;
    if (!self.pending.empty()) {
        auto event = std::move(self.pending.front());
        self.pending.pop_front();
        return event;
    }
    auto give_up_at = detail::deadline_after(timeout);
    while (true) {
        auto event = self.read(give_up_at);
        if (!event) return std::nullopt;
        // health events already in flight when the join unsubscribed them
        if (!(self.hide_health && event->first == kHealth)) return std::move(event->second);
    }
}

std::uint64_t EventSubscriber::connections_lost() const { return impl_->connections_lost; }

}  // namespace inferd
