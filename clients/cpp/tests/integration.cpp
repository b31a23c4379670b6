// Integration tests of the C++ client against a real `inferd run` (started by
// tests/integration/test_cpp_client.py, which passes the endpoints, the
// daemon's pid and the ONNX Runtime reference result in the environment).
// No sleep synchronises anything: each wait polls for the state it needs,
// with a bound (kHang) that only ends a hang.
#include <sched.h>
#include <signal.h>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <thread>

#include "check.hpp"
#include "inferd/inferd.hpp"

using namespace inferd;
using namespace std::chrono_literals;

namespace {

constexpr auto kHang = 15s;

std::string env(const char* name) {
    const char* value = std::getenv(name);
    if (value == nullptr) throw std::runtime_error(std::string("$") + name + " is not set");
    return value;
}

std::vector<float> read_floats(const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    std::string bytes(std::istreambuf_iterator<char>(file), {});
    std::vector<float> values(bytes.size() / sizeof(float));
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
    return values;
}

ClientOptions infer_options(std::chrono::milliseconds timeout = 10s) {
    ClientOptions options;
    options.endpoint = env("INFERD_INFER");
    options.timeout = timeout;
    return options;
}

ClientOptions control_options() {
    ClientOptions options;
    options.endpoint = env("INFERD_CONTROL");
    options.timeout = 30s;
    return options;
}

// The demo model's input as the driver wrote it, and ONNX Runtime's output for it.
struct Reference {
    std::vector<float> image = read_floats(env("INFERD_DATA") + "/image.f32");
    std::vector<float> descriptors = read_floats(env("INFERD_DATA") + "/descriptors.f32");

    std::vector<NamedTensor> inputs() const {
        return {{"image", view(DType::Float32, {1, 3, 224, 224}, image.data(), image.size() * 4)}};
    }
};

const Reference& reference() {
    static Reference loaded;
    return loaded;
}

float max_difference(const float* got, const std::vector<float>& expected) {
    float worst = 0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
        worst = std::max(worst, std::fabs(got[i] - expected[i]) / (1.0f + std::fabs(expected[i])));
    }
    return worst;
}

// The demo model's input (the reference image) and its output buffer in one
// region of `client`, and the options that place the output there.
struct DemoInRegion {
    SharedRegion* region;
    MutableTensorView image;
    MutableTensorView descriptors;
    std::vector<NamedTensor> inputs;
    InferOptions options;

    DemoInRegion(InferenceClient& client, const std::string& label)
        : region(&client.shared_region(4 << 20, label)),
          image(region->allocate(DType::Float32, {1, 3, 224, 224})),
          descriptors(region->allocate(DType::Float32, {1, 256, 28, 28})) {
        std::memcpy(image.data, reference().image.data(), image.nbytes);
        inputs = {{"image", TensorView{image.dtype, image.shape, image.data, image.nbytes}}};
        options.outputs.push_back({"descriptors", descriptors});
    }
};

// Returns once every thread of `pid` is stopped: a SIGSTOP stops a process only
// when one of its threads, woken for it, gets a CPU and stops the others; under
// load a busy thread meanwhile still answers a request sent after kill().
void wait_until_stopped(pid_t pid);

// Stops the daemon (SIGSTOP) while a request's first attempt waits, and continues
// it as the client retries: both attempts are answered, the first one too late.
struct RetryAfterStop {
    pid_t pid = static_cast<pid_t>(std::stol(env("INFERD_DAEMON_PID")));
    std::vector<std::uint64_t> ids;

    RetryAfterStop() = default;
    RetryAfterStop(const RetryAfterStop&) = delete;
    RetryAfterStop& operator=(const RetryAfterStop&) = delete;
    ~RetryAfterStop() { kill(pid, SIGCONT); }

    ClientOptions options() {
        ClientOptions options = infer_options(2s);
        options.retries = 1;
        options.on_attempt = [this](std::uint64_t id, int attempt) {
            ids.push_back(id);
            if (attempt == 1) kill(pid, SIGCONT);
        };
        return options;
    }
    void stop() {
        ids.clear();
        CHECK_EQ(kill(pid, SIGSTOP), 0);
        wait_until_stopped(pid);
    }
    // The result is the second attempt's; the first one's reply came and was let go.
    void check(const InferResult& result, const InferenceClient& client) const {
        CHECK_EQ(ids.size(), 2u);
        if (ids.size() != 2u) return;
        CHECK(ids[0] != ids[1]);
        CHECK(std::get<std::uint64_t>(result.reply.id) == ids[1]);
        CHECK_EQ(client.discarded_replies(), 1u);
    }
};

template <typename Predicate>
void wait_until(Predicate predicate, const std::string& what) {
    auto give_up_at = std::chrono::steady_clock::now() + kHang;
    while (!predicate()) {
        if (std::chrono::steady_clock::now() > give_up_at) {
            throw std::runtime_error(what + " not reached within 15 s");
        }
        std::this_thread::sleep_for(2ms);  // the polling interval, not a guess at when
    }
}

// Whether /proc/<pid>/task/<tid>/stat says stopped ('T') for every thread.
bool all_threads_stopped(pid_t pid) {
    auto tasks = std::filesystem::path("/proc") / std::to_string(pid) / "task";
    for (const auto& task : std::filesystem::directory_iterator(tasks)) {
        std::ifstream stat(task.path() / "stat");
        std::string line;
        std::getline(stat, line);
        auto state = line.rfind(')');  // the command name may hold spaces and parentheses
        if (state == std::string::npos || state + 2 >= line.size() || line[state + 2] != 'T') {
            return false;
        }
    }
    return true;
}

void wait_until_stopped(pid_t pid) {
    wait_until([pid] { return all_threads_stopped(pid); }, "the daemon's every thread stopped");
}

ModelStatus model_status(OperatorClient& operator_client, const std::string& name) {
    for (auto& model : operator_client.status().models) {
        if (model.model == name) return model;
    }
    throw std::runtime_error("no model " + name + " in status");
}

std::vector<float> slow_input() { return std::vector<float>(512 * 512, 1.0f); }

std::vector<NamedTensor> slow_inputs(const std::vector<float>& x) {
    return {{"x", view(DType::Float32, {512, 512}, x.data(), x.size() * 4)}};
}

ErrorCode code_of(const std::function<void()>& call) {
    try {
        call();
    } catch (const RemoteError& error) {
        return error.code();
    }
    throw std::runtime_error("the call succeeded; an error reply was expected");
}

}  // namespace

TEST(infer_with_the_demo_model_matches_onnx_runtime) {
    InferenceClient client(infer_options());
    auto result = client.infer("demo", reference().inputs());
    const auto& output = result.output("descriptors");
    CHECK(output.dtype == DType::Float32);
    CHECK_EQ(output.shape, (Shape{1, 256, 28, 28}));
    CHECK_EQ(output.nbytes, reference().descriptors.size() * 4);
    CHECK(max_difference(output.as<float>(), reference().descriptors) < 1e-4f);
    CHECK_EQ(result.reply.model, "demo");
    CHECK_EQ(result.reply.runtime, "onnx_trt_ep");
    CHECK(!result.reply.late && !result.reply.fallback);
    CHECK(result.reply.latency_us > 0);
    // The connection's kernel send buffer, sized once a reply came (DESIGN.md 116).
    CHECK_EQ(client.send_buffer().sized, std::uint64_t{1});
    CHECK(client.send_buffer().effective_bytes.value_or(0) > 0);

    // The same into a buffer of the caller's
    std::vector<float> mine(reference().descriptors.size());
    InferOptions into;
    into.outputs.push_back({"descriptors", mutable_view(DType::Float32, {1, 256, 28, 28}, mine.data(),
                                                        mine.size() * 4)});
    auto written = client.infer("demo", reference().inputs(), into);
    CHECK(written.output("descriptors").data == mine.data());
    CHECK(max_difference(mine.data(), reference().descriptors) < 1e-4f);
}

TEST(shared_memory_inputs_and_outputs_skip_the_socket) {
    InferenceClient client(infer_options());
    auto& region = client.shared_region(4 << 20, std::string("cpp-test"));
    auto image = region.allocate(DType::Float32, {1, 3, 224, 224});
    std::memcpy(image.data, reference().image.data(), image.nbytes);
    auto descriptors = region.allocate(DType::Float32, {1, 256, 28, 28});
    InferOptions options;
    options.outputs.push_back({"descriptors", descriptors});
    auto result = client.infer(
        "demo", {{"image", TensorView{image.dtype, image.shape, image.data, image.nbytes}}}, options);
    CHECK(result.reply.outputs.at(0).region.has_value());  // written in place: no frame
    CHECK(result.output("descriptors").data == descriptors.data);
    CHECK(max_difference(descriptors.as<float>(), reference().descriptors) < 1e-4f);
    client.unregister_region(region);
    // An unregistered region's bytes travel as frames again.
    auto again = client.infer("demo", {{"image", TensorView{image.dtype, image.shape, image.data, image.nbytes}}});
    CHECK(!again.reply.outputs.at(0).region.has_value());
}

TEST(requests_with_every_tensor_in_a_region_go_on_the_shm_socket) {
    InferenceClient client(infer_options());
    DemoInRegion demo(client, "cpp-shm");
    // The model's outputs are not known yet: the infer socket, whose reply names them.
    client.infer("demo", demo.inputs, demo.options);
    CHECK_EQ(client.last_transport(), std::string("infer"));
    std::memset(demo.descriptors.data, 0, demo.descriptors.nbytes);
    auto result = client.infer("demo", demo.inputs, demo.options);
    CHECK_EQ(client.last_transport(), std::string("shm"));
    CHECK(result.reply.ok && result.reply.model == "demo");
    CHECK(result.reply.outputs.at(0).region.has_value());
    CHECK(result.output("descriptors").data == demo.descriptors.data);
    CHECK(max_difference(demo.descriptors.as<float>(), reference().descriptors) < 1e-4f);
    // An input in a frame: the infer socket again.
    client.infer("demo", reference().inputs(), demo.options);
    CHECK_EQ(client.last_transport(), std::string("infer"));
    // A refusal on the shm socket is the daemon's code, and the model's outputs
    // are learnt again from the next reply on the infer socket.
    auto wrong = demo.region->allocate(DType::Float32, {1, 3, 8, 8});
    CHECK_THROWS(RemoteError,
                 client.infer("demo", {{"image", TensorView{wrong.dtype, wrong.shape, wrong.data,
                                                            wrong.nbytes}}},
                              demo.options),
                 error.code() == ErrorCode::InvalidArgument);
    CHECK_EQ(client.last_transport(), std::string("shm"));
    client.infer("demo", demo.inputs, demo.options);
    CHECK_EQ(client.last_transport(), std::string("infer"));
    client.infer("demo", demo.inputs, demo.options);
    CHECK_EQ(client.last_transport(), std::string("shm"));
}

TEST(replies_polled_for_in_their_window_are_the_daemons_and_the_window_is_accounted) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    sched_getaffinity(0, sizeof allowed, &allowed);
    if (CPU_COUNT(&allowed) < 2) return;  // the window is off on one CPU (unit tests)
    auto options = infer_options();
    options.reply_spin_us = 10000;  // as wide as allowed: it opens at once
    InferenceClient client(options);
    DemoInRegion demo(client, "cpp-window");
    client.describe();  // names the outputs: every request goes on shm.sock
    const int requests = 12;
    for (int i = 0; i < requests; ++i) {
        std::memset(demo.descriptors.data, 0, demo.descriptors.nbytes);
        auto result = client.infer("demo", demo.inputs, demo.options);
        CHECK_EQ(client.last_transport(), std::string("shm"));
        CHECK(max_difference(demo.descriptors.as<float>(), reference().descriptors) < 1e-4f);
    }
    auto spin = client.reply_spin();
    // The first reply is waited for as ever (nothing learned); each later one went
    // through a window: caught in it, there before it, or not in it.
    CHECK(spin.caught >= 1);
    CHECK_EQ(spin.caught + spin.early + spin.missed, std::uint64_t{requests - 1});
    // Each window ends at its close, but a loaded machine may preempt the thread in
    // its last poll past it (a CI run of ctest -j2 beside the consumer builds did):
    // 0.2 s in all for that, still far below a window that never closes.
    CHECK(spin.us == 10000 && spin.spent_us <= std::uint64_t{(requests - 1) * 10000 + 200000});
}

TEST(describe_names_the_outputs_for_the_shm_socket) {
    InferenceClient client(infer_options());
    DemoInRegion demo(client, "cpp-describe");
    client.describe();
    client.infer("demo", demo.inputs, demo.options);
    CHECK_EQ(client.last_transport(), std::string("shm"));
    CHECK(max_difference(demo.descriptors.as<float>(), reference().descriptors) < 1e-4f);
}

TEST(describe_lists_the_models_with_their_specs) {
    InferenceClient client(infer_options());
    auto models = client.describe();
    bool found = false;
    for (const auto& model : models) {
        if (model.name != "demo") continue;
        found = true;
        CHECK_EQ(model.state, "serving");
        CHECK_EQ(model.inputs.at(0).name, "image");
        CHECK(model.inputs.at(0).dtype == DType::Float32);
        CHECK_EQ(model.outputs.at(0).name, "descriptors");
    }
    CHECK(found);
}

TEST(errors_a_request_alone_provokes) {
    InferenceClient client(infer_options());
    std::vector<float> wrong(3 * 224 * 225);
    CHECK_EQ(code_of([&] {
                 client.infer("demo", {{"image", view(DType::Float32, {1, 3, 224, 225}, wrong.data(),
                                                      wrong.size() * 4)}});
             }),
             ErrorCode::InvalidArgument);
    CHECK_EQ(code_of([&] { client.infer("nope", reference().inputs()); }), ErrorCode::NotFound);
    float x[4] = {0, 0, 0, 0};
    CHECK_EQ(code_of([&] { client.infer("broken", {{"x", view(DType::Float32, {4}, x, sizeof x)}}); }),
             ErrorCode::Unavailable);
    // Shapes the model accepts (dynamic dims) that its Add cannot broadcast: the runtime fails.
    float a[2] = {1, 2}, b[3] = {1, 2, 3};
    CHECK_THROWS(RemoteError,
                 client.infer("adder", {{"a", view(DType::Float32, {2}, a, sizeof a)},
                                        {"b", view(DType::Float32, {3}, b, sizeof b)}}),
                 error.code() == ErrorCode::Internal && !error.message().empty());
    OperatorClient operator_client(control_options());
    // No TensorRT on this machine: preparing the switch fails, nothing changes.
    CHECK_EQ(code_of([&] { operator_client.switch_runtime("demo", "tensorrt", std::string("cpp")); }),
             ErrorCode::FailedPrecondition);
    // A loopback tcp:// control socket without CURVE: no verified peer, no operator.
    ClientOptions anonymous = control_options();
    anonymous.endpoint = env("INFERD_TCP_CONTROL");
    OperatorClient stranger(anonymous);
    CHECK_EQ(stranger.status().state, "serving");
    CHECK_EQ(code_of([&] { stranger.switch_runtime("demo", "onnx_trt_ep"); }),
             ErrorCode::PermissionDenied);
}

// The client's bound on a reply frame travels in each request (DESIGN.md 248): the
// daemon answers a reply that would not fit RESOURCE_EXHAUSTED, whatever the
// retries (the demo's output shape is static: refused before it runs), and the
// connection stays up.
TEST(a_reply_over_the_clients_frame_bound_is_refused_by_the_daemon_once) {
    ClientOptions options = infer_options();
    options.max_reply_frame_bytes = 100000;  // the demo's output is 802,816 bytes
    options.retries = 2;
    InferenceClient client(options);
    OperatorClient operator_client(control_options());
    auto runs = [&] {
        for (const auto& model : operator_client.status().models)
            if (model.model == "demo") return model.requests;
        throw std::runtime_error("no demo model in status");
    };
    auto before = runs();
    CHECK_THROWS(RemoteError, client.infer("demo", reference().inputs()),
                 error.code() == ErrorCode::ResourceExhausted &&
                     error.message() ==
                         "output 'descriptors' is 802816 bytes, over this request's "
                         "max_reply_frame_bytes = 100000; the request was not run");
    CHECK_EQ(runs() - before, std::uint64_t{1});
    CHECK_EQ(client.connections_lost(), std::uint64_t{0});
    // Outputs written into a region are no frames: not bounded by it.
    auto& region = client.shared_region(4 << 20, std::string("cpp-bound"));
    auto image = region.allocate(DType::Float32, {1, 3, 224, 224});
    std::memcpy(image.data, reference().image.data(), image.nbytes);
    InferOptions into;
    into.outputs.push_back({"descriptors", region.allocate(DType::Float32, {1, 256, 28, 28})});
    auto result = client.infer(
        "demo", {{"image", TensorView{image.dtype, image.shape, image.data, image.nbytes}}}, into);
    CHECK(max_difference(result.output("descriptors").as<float>(), reference().descriptors) < 1e-4f);
}

TEST(errors_a_busy_engine_worker_provokes) {
    OperatorClient operator_client(control_options());
    auto before = model_status(operator_client, "slow").requests;
    auto x = slow_input();
    // A runs on the (single) engine worker; B waits in slow's queue of one.
    auto run_slow = [&] {
        InferenceClient client(infer_options(30s));
        return client.infer("slow", slow_inputs(x)).reply.ok;
    };
    auto a = std::async(std::launch::async, run_slow);
    wait_until([&] {
        auto slow = model_status(operator_client, "slow");
        return slow.requests == before + 1 && slow.queue_depth == 0;
    }, "A on the engine worker");
    auto b = std::async(std::launch::async, run_slow);
    wait_until([&] { return operator_client.health().models.at("slow").queue_depth == 1; },
               "B queued");

    InferenceClient client(infer_options());
    CHECK_EQ(code_of([&] { client.infer("slow", slow_inputs(x)); }), ErrorCode::ResourceExhausted);
    InferOptions hurried;
    hurried.deadline_ms = 1;
    CHECK_EQ(code_of([&] { client.infer("demo", reference().inputs(), hurried); }),
             ErrorCode::DeadlineExceeded);

    // queue_policy "latest": a newer request of the same connection supersedes its
    // queued one, which is answered CANCELLED. One synchronous client never has
    // two requests queued, so this uses the codec on a DEALER of its own.
    zmq::socket_t dealer(*shared_context(), zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.connect(env("INFERD_INFER"));
    for (std::uint64_t id : {101, 102}) {
        wire::InferRequest request{
            id, "slow_latest", {{"x", DType::Float32, {512, 512}, std::nullopt}}, {}, {}, {}};
        auto header = wire::encode_infer_request(request);
        dealer.send(zmq::buffer(header), zmq::send_flags::sndmore);
        dealer.send(zmq::buffer(x.data(), x.size() * 4), zmq::send_flags::none);
    }
    std::map<std::uint64_t, wire::InferReply> replies;
    while (replies.size() < 2) {
        zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
        if (zmq::poll(&item, 1, std::chrono::milliseconds(kHang)) == 0) break;
        std::vector<zmq::message_t> parts;
        (void)zmq::recv_multipart(dealer, std::back_inserter(parts));
        auto reply = wire::decode_infer_reply(parts[0].data(), parts[0].size());
        replies[std::get<std::uint64_t>(reply.id)] = reply;
    }
    CHECK(replies.count(101) && !replies[101].ok && replies[101].error->code == ErrorCode::Cancelled);
    CHECK(replies.count(102) && replies[102].ok);
    CHECK(a.get() && b.get());
}

TEST(a_result_after_its_deadline_is_served_and_flagged_late) {
    InferenceClient client(infer_options(30s));
    auto x = slow_input();
    InferOptions options;
    // Starts at once on the idle worker and takes far longer than this.
    options.deadline_ms = static_cast<std::uint32_t>(std::stoul(env("INFERD_SLOW_CALL_MS")) / 3 + 1);
    auto late = client.infer("slow", slow_inputs(x), options);
    CHECK(late.reply.ok && late.reply.late);
    CHECK_EQ(late.outputs.size(), 1u);
    auto in_time = client.infer("demo", reference().inputs());
    CHECK(!in_time.reply.late);
    OperatorClient operator_client(control_options());
    CHECK(model_status(operator_client, "slow").late_results >= 1);
}

TEST(a_retry_goes_under_a_fresh_id_and_the_late_reply_is_discarded) {
    RetryAfterStop retry;
    InferenceClient client(retry.options());
    // Connected first: a request is queued only on a connection that is up
    // (ZMQ_IMMEDIATE), so one sent before the daemon's handshake would wait.
    client.infer("demo", reference().inputs());
    retry.stop();
    auto result = client.infer("demo", reference().inputs());
    retry.check(result, client);
    CHECK(max_difference(result.output("descriptors").as<float>(), reference().descriptors) < 1e-4f);
}

TEST(a_retry_on_the_shm_socket_goes_under_a_fresh_id_and_the_late_reply_is_discarded) {
    RetryAfterStop retry;
    InferenceClient client(retry.options());
    DemoInRegion demo(client, "cpp-retry");
    client.describe();  // names the outputs: both attempts go on shm.sock
    retry.stop();
    auto result = client.infer("demo", demo.inputs, demo.options);
    CHECK_EQ(client.last_transport(), std::string("shm"));
    retry.check(result, client);
    CHECK(max_difference(demo.descriptors.as<float>(), reference().descriptors) < 1e-4f);
}

// How many regions the daemon holds under `label` (status: shm.regions).
std::size_t regions_labelled(OperatorClient& operator_client, const std::string& label) {
    auto json = operator_client.status().json;
    std::size_t count = 0;
    for (auto at = json.find("\"" + label + "\""); at != std::string::npos;
         at = json.find("\"" + label + "\"", at + 1)) {
        ++count;
    }
    return count;
}

// The number status gives under `key` (its first occurrence).
std::size_t status_number(const std::string& json, const std::string& key) {
    auto at = json.find("\"" + key + "\"");
    CHECK(at != std::string::npos);
    if (at == std::string::npos) return 0;
    at = json.find_first_not_of(": ", at + key.size() + 2);
    return static_cast<std::size_t>(std::stoul(json.substr(at)));
}

TEST(a_registration_that_timed_out_and_was_made_late_is_the_retrys) {
    pid_t pid = static_cast<pid_t>(std::stol(env("INFERD_DAEMON_PID")));
    InferenceClient client(infer_options(1s));
    OperatorClient operator_client(control_options());
    // One region more fits the connection (shm.max_regions_per_connection), not
    // two copies of it. Before, the retry was sent first and refused for the
    // daemon's late copy (review RD).
    auto bound = status_number(operator_client.status().json, "max_regions_per_connection");
    for (std::size_t i = 0; i + 1 < bound; ++i) client.shared_region(4096, std::string("cpp-late-open"));
    SharedRegion region(8192, std::string("cpp-late-register"));
    CHECK_EQ(kill(pid, SIGSTOP), 0);
    wait_until_stopped(pid);
    CHECK_THROWS(Timeout, client.register_region(region), true);
    CHECK_EQ(kill(pid, SIGCONT), 0);
    // The daemon registers it late (the reply names a region nobody was told of):
    // the retry reads that reply before it sends anything, and takes it.
    wait_until([&] { return regions_labelled(operator_client, "cpp-late-register") == 1; },
               "the late registration");
    auto id = client.register_region(region);
    CHECK_EQ(id.size(), 32u);
    CHECK_EQ(regions_labelled(operator_client, "cpp-late-register"), 1u);
    CHECK_EQ(client.shm_regions().registered, bound);
    CHECK_EQ(client.discarded_replies(), 0u);  // taken, not discarded
    client.unregister_region(region);
    // Listed (as releasing) until the daemon's registration thread unmaps it.
    wait_until([&] { return regions_labelled(operator_client, "cpp-late-register") == 0; },
               "the unregistered region unmapped");
}

TEST(a_prefix_of_health_receives_health_events) {
    SubscriberOptions options;
    options.endpoint = env("INFERD_EVENTS");
    options.topics = {"he"};
    EventSubscriber events(options);
    events.wait_joined(kHang);
    for (int i = 0; i < 2; ++i) {  // the join's own event, then a later one
        auto event = events.receive(kHang);
        CHECK(event && std::holds_alternative<HealthEvent>(*event));
    }
}

TEST(events_arrive_decoded) {
    SubscriberOptions options;
    options.endpoint = env("INFERD_EVENTS");
    options.topics = {"runtime", "alert", "thermal", "build"};
    EventSubscriber events(options);
    events.wait_joined(kHang);
    OperatorClient operator_client(control_options());
    auto switched = operator_client.switch_runtime("demo", "onnx_trt_ep", std::string("cpp-test"));
    CHECK_EQ(switched.to_runtime, "onnx_trt_ep");
    // The first inference served by the fallback raises fallback_to_onnx_trt_ep.
    InferenceClient client(infer_options());
    CHECK(client.infer("fallback_demo", reference().inputs()).reply.fallback);
    auto build = operator_client.call("build.start", {{"model", std::string("demo")},
                                                      {"builder", std::string("simulated")}});
    CHECK(build.find("\"simulated\":true") != std::string::npos);

    bool runtime = false, alert = false, thermal = false, build_done = false;
    auto give_up_at = std::chrono::steady_clock::now() + kHang;
    while (!(runtime && alert && thermal && build_done) && std::chrono::steady_clock::now() < give_up_at) {
        auto event = events.receive(1s);
        if (!event) continue;
        if (auto* r = std::get_if<RuntimeEvent>(&*event)) {
            runtime = runtime || (r->model == "demo" && r->state == "serving" && r->stamp.seq > 0);
        } else if (auto* a = std::get_if<AlertEvent>(&*event)) {
            alert = alert || (a->code == "fallback_to_onnx_trt_ep" && a->level == "WARNING" &&
                              a->fields_json.find("fallback_demo") != std::string::npos);
        } else if (auto* t = std::get_if<ThermalEvent>(&*event)) {
            thermal = thermal || (!t->available && !t->throttle_active && t->measured_at_ns > 0);
        } else if (auto* b = std::get_if<BuildEvent>(&*event)) {
            build_done = build_done || (b->type == "completed" && b->simulated && b->model == "demo");
        } else {
            CHECK(false);  // health was not subscribed to: the join hid it
        }
    }
    CHECK(runtime);
    CHECK(alert);
    CHECK(thermal);
    CHECK(build_done);
    auto health = operator_client.health();
    CHECK(health.engine_worker_alive && health.models.count("demo"));
}

TEST(a_runtime_switch_under_load_fails_no_request) {
    std::atomic<bool> stop{false};
    std::atomic<int> served{0}, failed{0};
    auto load = [&] {
        InferenceClient client(infer_options());
        while (!stop) {
            try {
                client.infer("demo", reference().inputs());
                ++served;
            } catch (const std::exception& error) {
                std::cerr << "request failed during the switch: " << error.what() << "\n";
                ++failed;
            }
        }
    };
    std::thread first(load), second(load);
    wait_until([&] { return served > 2; }, "load running");
    OperatorClient operator_client(control_options());
    for (int i = 0; i < 3; ++i) {
        int before = served;
        operator_client.switch_runtime("demo", "onnx_trt_ep", std::string("cpp-load"));
        wait_until([&] { return served > before + 1; }, "requests served after the switch");
    }
    stop = true;
    first.join();
    second.join();
    CHECK_EQ(failed.load(), 0);
    CHECK(served > 6);
    std::cout << "served " << served << " requests across 3 switches, " << failed << " failed\n";
}

TEST_ON_DEMAND(curve_on_tcp_admits_the_allow_listed_key_and_its_operator_rights) {
    // A daemon with every socket on tcp:// and security.curve; `inferd keys` made
    // the two client certificates: ground (an operator) and viewer.
    auto server_key = env("INFERD_CURVE_SERVER_KEY");
    auto ground = ClientCurve::from_files(server_key, env("INFERD_CURVE_GROUND"));
    auto viewer = ClientCurve::from_files(server_key, env("INFERD_CURVE_VIEWER"));
    ClientOptions options = infer_options();
    options.curve = viewer;
    InferenceClient client(options);
    auto result = client.infer("demo", reference().inputs());
    CHECK(max_difference(result.output("descriptors").as<float>(), reference().descriptors) < 1e-4f);
    SubscriberOptions subscription;
    subscription.endpoint = env("INFERD_EVENTS");
    subscription.curve = viewer;
    EventSubscriber events(subscription);
    events.wait_joined(kHang);
    ClientOptions control = control_options();
    control.curve = viewer;
    OperatorClient viewing(control);
    CHECK_EQ(viewing.status().state, "serving");
    CHECK_EQ(code_of([&] { viewing.switch_runtime("demo", "onnx_trt_ep"); }), ErrorCode::PermissionDenied);
    control.curve = ground;
    OperatorClient operating(control);
    CHECK_EQ(operating.switch_runtime("demo", "onnx_trt_ep", std::string("cpp-curve")).to_runtime,
             "onnx_trt_ep");
    // A key the daemon does not know: its ZAP handler refuses the handshake, and
    // the call says so at once (before: no answer, a Timeout after 1 s).
    ClientCurve stranger = viewer;
    char public_key[41], secret_key[41];
    CHECK_EQ(zmq_curve_keypair(public_key, secret_key), 0);
    stranger.public_key = public_key;
    stranger.secret_key = secret_key;
    ClientOptions refused = control_options();
    refused.curve = stranger;
    refused.timeout = 10s;
    OperatorClient unknown(refused);
    auto started = std::chrono::steady_clock::now();
    CHECK_THROWS(ConnectionRefused, unknown.status(), error.status() == 400);
    CHECK(std::chrono::steady_clock::now() - started < 5s);
    // Its events subscriber likewise (before: "no health event" after the 10 s).
    SubscriberOptions unheard = subscription;
    unheard.curve = stranger;
    EventSubscriber strange_events(unheard);
    started = std::chrono::steady_clock::now();
    CHECK_THROWS(ConnectionRefused, strange_events.wait_joined(10s), error.status() == 400);
    CHECK(std::chrono::steady_clock::now() - started < 5s);
    // CURVE is for tcp:// only.
    ClientOptions local = control_options();
    local.endpoint = "ipc:///nonexistent-dir/control.sock";
    local.curve = viewer;
    CHECK_THROWS(ClientError, OperatorClient{local}, std::string(error.what()).find("tcp://") != std::string::npos);
}

int main(int argc, char** argv) { return inferd::testing::run_all(argc, argv); }
