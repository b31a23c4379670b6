// The C++ side of schemas/conformance: reads a plan (one vector per line, made
// from manifest.json by tests/unit/client/test_conformance.py), encodes or
// decodes each vector with the library, and prints one JSON line per vector:
// {"name": ..., "hex": ...} for a request, {"name": ..., "decoded": ...} for a
// reply or event (the canonical form of generate.py, or {"malformed": true}).
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "inferd/inferd.hpp"
#include "json_writer.hpp"

namespace {

using namespace inferd;
using testing::Object;

std::string read_file(const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    if (!file) throw std::runtime_error("cannot read " + path);
    return std::string(std::istreambuf_iterator<char>(file), {});
}

std::string hex(const std::string& bytes) {
    static const char digits[] = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

std::string shape_json(const Shape& shape) {
    std::vector<std::string> dims;
    for (auto dim : shape) dims.push_back(std::to_string(dim));
    return testing::array(dims);
}

wire::TensorDescriptor read_descriptor(std::istream& in) {
    wire::TensorDescriptor descriptor;
    std::string dtype, region;
    std::size_t rank = 0;
    in >> descriptor.name >> dtype >> rank;
    descriptor.dtype = parse_dtype(dtype);
    for (std::size_t i = 0; i < rank; ++i) {
        std::int64_t dim = 0;
        in >> dim;
        descriptor.shape.push_back(dim);
    }
    in >> region;
    if (region != "-") {
        wire::RegionRef ref{region, 0, 0};
        in >> ref.offset >> ref.nbytes;
        descriptor.region = ref;
    }
    return descriptor;
}

std::vector<wire::TensorDescriptor> read_descriptors(std::istream& in) {
    std::size_t count = 0;
    in >> count;
    std::vector<wire::TensorDescriptor> descriptors;
    for (std::size_t i = 0; i < count; ++i) descriptors.push_back(read_descriptor(in));
    return descriptors;
}

std::string id_json(const wire::RequestId& id) {
    if (const auto* number = std::get_if<std::uint64_t>(&id)) return std::to_string(*number);
    if (const auto* text = std::get_if<std::string>(&id)) return testing::quote(*text);
    return "null";
}

std::string error_json(const wire::RequestId& id, const wire::ErrorInfo& error) {
    Object info;
    info.str("code", std::string(error_code_name(error.code))).str("message", error.message);
    return Object().uint("v", 1).raw("id", id_json(id)).boolean("ok", false).raw("error", info.str()).str();
}

std::string descriptor_json(const wire::TensorDescriptor& descriptor, const std::string& data) {
    Object object;
    object.str("name", descriptor.name)
        .str("dtype", std::string(dtype_name(descriptor.dtype)))
        .raw("shape", shape_json(descriptor.shape));
    if (descriptor.region) {
        object.str("region", descriptor.region->region)
            .uint("offset", descriptor.region->offset)
            .uint("nbytes", descriptor.region->nbytes);
    } else {
        object.str("data_hex", hex(data));
    }
    return object.str();
}

// As InferenceClient::infer reads a reply: the header, then the outputs.
std::string decode_infer(const std::vector<std::string>& parts,
                         const std::vector<wire::TensorDescriptor>& asked) {
    auto reply = wire::decode_infer_reply(parts[0].data(), parts[0].size());
    if (!reply.ok) return error_json(reply.id, *reply.error);
    std::vector<wire::FrameBytes> frames;
    for (std::size_t i = 1; i < parts.size(); ++i) frames.push_back({parts[i].data(), parts[i].size()});
    std::vector<std::string> buffers;  // the caller's memory for placed outputs
    std::vector<NamedOutputBuffer> into;
    buffers.reserve(asked.size());
    for (const auto& placed : asked) {
        buffers.emplace_back(tensor_bytes(placed.dtype, placed.shape), '\0');
        into.push_back({placed.name, MutableTensorView{placed.dtype, placed.shape,
                                                       buffers.back().data(), buffers.back().size()}});
    }
    auto outputs = wire::decode_outputs(reply, frames, asked, into);
    std::vector<std::string> rendered;
    for (std::size_t i = 0; i < reply.outputs.size(); ++i) {
        const auto& view = outputs[i].tensor;
        rendered.push_back(descriptor_json(
            reply.outputs[i], std::string(static_cast<const char*>(view.data), view.nbytes)));
    }
    return Object()
        .uint("v", 1)
        .raw("id", id_json(reply.id))
        .boolean("ok", true)
        .str("model", reply.model)
        .str("runtime", reply.runtime)
        .boolean("fallback", reply.fallback)
        .uint("latency_us", reply.latency_us)
        .uint("queue_us", reply.queue_us)
        .boolean("late", reply.late)
        .str("thermal", std::string(wire::thermal_summary_name(reply.thermal)))
        .raw("outputs", testing::array(rendered))
        .str();
}

std::string health_json(const HealthSnapshot& health, const Object& prefix = Object()) {
    Object threads;
    threads.boolean("engine_worker", health.engine_worker_alive)
        .boolean("bus", health.bus_alive)
        .boolean("publisher", health.publisher_alive);
    Object models;
    for (const auto& [name, model] : health.models) {
        models.raw(name, Object()
                             .str("state", model.state)
                             .str("runtime", model.runtime)
                             .boolean("fallback", model.fallback)
                             .uint("queue_depth", model.queue_depth)
                             .str());
    }
    Object object = prefix;
    return object.str("state", health.state)
        .num("uptime_s", health.uptime_s)
        .raw("threads", threads.str())
        .raw("models", models.str())
        .str("thermal", std::string(wire::thermal_summary_name(health.thermal)))
        .str();
}

std::string spec_json(const TensorSpec& spec) {
    std::vector<std::string> dims;
    for (const auto& dim : spec.shape) dims.push_back(dim ? std::to_string(*dim) : "null");
    Object object;
    object.str("name", spec.name)
        .str("dtype", std::string(dtype_name(spec.dtype)))
        .raw("shape", testing::array(dims));
    if (!spec.profile_json.empty()) object.raw("profile", spec.profile_json);
    return object.str();
}

// A control reply's result, decoded by the client's own decoders (through a
// scripted exchange would need a socket: the decoders are reached through the
// public decode helpers instead).
std::string decode_control(const std::string& op, const std::string& part) {
    auto reply = wire::decode_control_reply(part.data(), part.size());
    if (!reply.ok) return error_json(reply.id, *reply.error);
    const auto& result = reply.result_msgpack;
    if (op == "health") return health_json(wire::decode_health_result(result.data(), result.size()));
    if (op == "runtime.switch") {
        auto switched = wire::decode_switch_result(result.data(), result.size());
        return Object()
            .str("model", switched.model)
            .str("from_runtime", switched.from_runtime)
            .str("to_runtime", switched.to_runtime)
            .strings("active_providers", switched.active_providers)
            .num("prepare_ms", switched.prepare_ms)
            .num("swap_ms", switched.swap_ms)
            .str();
    }
    if (op == "describe") {
        std::vector<std::string> models;
        for (const auto& model : wire::decode_describe_result(result.data(), result.size())) {
            std::vector<std::string> inputs, outputs;
            for (const auto& spec : model.inputs) inputs.push_back(spec_json(spec));
            for (const auto& spec : model.outputs) outputs.push_back(spec_json(spec));
            models.push_back(Object()
                                 .str("name", model.name)
                                 .str("state", model.state)
                                 .raw("inputs", testing::array(inputs))
                                 .raw("outputs", testing::array(outputs))
                                 .str());
        }
        return Object().raw("models", testing::array(models)).str();
    }
    throw std::runtime_error("no decoder for op " + op);
}

Object stamp_json(const EventStamp& stamp) {
    Object object;
    object.uint("ts_ns", stamp.ts_ns).uint("seq", stamp.seq);
    return object;
}

std::string event_json(const Event& event) {
    if (const auto* health = std::get_if<HealthEvent>(&event)) {
        return health_json(health->health, stamp_json(health->stamp));
    }
    if (const auto* runtime = std::get_if<RuntimeEvent>(&event)) {
        return stamp_json(runtime->stamp)
            .str("model", runtime->model)
            .str("state", runtime->state)
            .str("configured_runtime", runtime->configured_runtime)
            .str("runtime", runtime->runtime)
            .boolean("fallback", runtime->fallback)
            .strings("active_providers", runtime->active_providers)
            .strings("requested_providers", runtime->requested_providers)
            .str("provider_degradation", runtime->provider_degradation)
            .str("engine_cache_error", runtime->engine_cache_error)
            .str("reason", runtime->reason)
            .str();
    }
    if (const auto* alert = std::get_if<AlertEvent>(&event)) {
        return stamp_json(alert->stamp)
            .str("level", alert->level)
            .str("code", alert->code)
            .str("message", alert->message)
            .raw("fields", alert->fields_json)
            .str();
    }
    if (const auto* thermal = std::get_if<ThermalEvent>(&event)) {
        return stamp_json(thermal->stamp)
            .str("source", thermal->source)
            .boolean("available", thermal->available)
            .boolean("throttle_active", thermal->throttle_active)
            .num("cpu_temp_c", thermal->cpu_temp_c)
            .num("gpu_temp_c", thermal->gpu_temp_c)
            .num("clock_mhz", thermal->clock_mhz)
            .uint("measured_at_ns", thermal->measured_at_ns)
            .boolean("transition", thermal->transition)
            .str();
    }
    const auto& build = std::get<BuildEvent>(event);
    Object object = stamp_json(build.stamp);
    object.str("buildId", build.build_id)
        .uint("eventSeq", build.event_seq)
        .str("type", build.type)
        .str("phaseId", build.phase_id)
        .str("parentId", build.parent_id)
        .str("name", build.name)
        .uint("step", build.step)
        .uint("numSteps", build.num_steps)
        .uint("monotonicNs", build.monotonic_ns)
        .uint("wallNs", build.wall_ns)
        .str("thread", build.thread)
        .str("cancelState", build.cancel_state);
    if (!build.detail_json.empty()) object.raw("detail", build.detail_json);
    return object.str("model", build.model)
        .str("builder", build.builder)
        .boolean("simulated", build.simulated)
        .uint("coalescedSteps", build.coalesced_steps)
        .str();
}

std::string run(const std::string& kind, std::istream& in, const std::string& directory) {
    auto file = [&](std::istream& stream) {
        std::string name;
        stream >> name;
        return read_file(directory + "/" + name);
    };
    if (kind == "infer_request") {
        wire::InferRequest request;
        std::string deadline, bound;
        in >> request.id >> request.model >> deadline >> bound;
        if (deadline != "-") request.deadline_ms = static_cast<std::uint32_t>(std::stoul(deadline));
        if (bound != "-") request.max_reply_frame_bytes = std::stoll(bound);
        request.inputs = read_descriptors(in);
        request.outputs = read_descriptors(in);
        return testing::quote(hex(wire::encode_infer_request(request)));
    }
    if (kind == "topic") {  // not a wire vector: which subscriptions the client sends
        std::string topic;
        in >> topic;
        try {
            check_topic(topic == "-" ? "" : topic);
            return "true";
        } catch (const std::invalid_argument&) {
            return "false";
        }
    }
    if (kind == "describe_request") {
        std::uint64_t id = 0;
        in >> id;
        return testing::quote(hex(wire::encode_describe_request(id)));
    }
    if (kind == "control_request") {
        std::uint64_t id = 0;
        std::string op;
        std::size_t count = 0;
        in >> id >> op >> count;
        wire::ControlArguments arguments;
        for (std::size_t i = 0; i < count; ++i) {
            std::string key, type, value;
            in >> key >> type >> value;
            if (type == "s") arguments.emplace_back(key, value);
            if (type == "i") arguments.emplace_back(key, static_cast<std::int64_t>(std::stoll(value)));
            if (type == "b") arguments.emplace_back(key, value == "true");
        }
        return testing::quote(hex(wire::encode_control_request(id, op, arguments)));
    }
    try {
        if (kind == "infer_reply") {
            std::size_t count = 0;
            in >> count;
            std::vector<std::string> parts;
            for (std::size_t i = 0; i < count; ++i) parts.push_back(file(in));
            auto asked = read_descriptors(in);
            return decode_infer(parts, asked);
        }
        if (kind == "control_reply") {
            std::string op;
            in >> op;
            return decode_control(op, file(in));
        }
        if (kind == "event") {
            std::string topic;
            in >> topic;
            auto payload = file(in);
            return event_json(decode_event(topic, payload.data(), payload.size()));
        }
    } catch (const MalformedReply&) {
        return R"({"malformed":true})";
    }
    throw std::runtime_error("unknown vector kind " + kind);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: inferd_conformance VECTOR_DIR < plan\n";
        return 2;
    }
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string kind, name;
        in >> kind >> name;
        auto rendered = run(kind, in, argv[1]);
        std::cout << "{\"name\":" << testing::quote(name) << ",\"result\":" << rendered << "}\n";
    }
    return 0;
}
