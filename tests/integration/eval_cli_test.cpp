// Black-box tests of `lorasync eval` through the real binary: a tiny random model with the Qwen2
// tokenizer and a small JSONL set, evaluated in-process (with and without an adapter) and through a
// `lorasync serve` started on port 0 (with an API key); determinism with a fixed seed, agreement of
// the two modes under greedy decoding, and the error paths (bad data: exit 1 naming the line; an
// unreachable server, a rejected key or an unknown model: exit 1 with the reason; bad flags: 2).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <mutex>
#include <set>
#include <thread>

#include "util/child_process.h"
#include "util/files.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::run_lorasync;
using testing::shell_quote;

// A fake /v1/completions upstream on 127.0.0.1:0: answers every request with reply(request JSON)
// and records the request heads and bodies. One connection at a time, keep-alive (the eval runs
// with --concurrency 1 against it).
class FakeUpstream {
 public:
  explicit FakeUpstream(std::function<json(const json&)> reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 16) != 0) std::abort();
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeUpstream() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }
  std::vector<std::pair<std::string, json>> requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }

 private:
  void serve() {
    for (;;) {
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::string buf;
      char tmp[65536];
      for (;;) {
        auto he = buf.find("\r\n\r\n");
        if (he != std::string::npos) {
          std::string head = buf.substr(0, he);
          std::size_t n_body = 0;
          std::string lower = head;
          for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
          if (auto cl = lower.find("content-length:"); cl != std::string::npos)
            n_body = std::stoul(head.substr(cl + 15));
          if (buf.size() >= he + 4 + n_body) {
            json req = json::parse(buf.substr(he + 4, n_body), nullptr, false);
            buf.erase(0, he + 4 + n_body);
            {
              std::lock_guard<std::mutex> l(mu_);
              requests_.emplace_back(head, req);
            }
            std::string body = reply_(req).dump();
            std::string resp = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
                               std::to_string(body.size()) + "\r\n\r\n" + body;
            if (::send(c, resp.data(), resp.size(), MSG_NOSIGNAL) < 0) break;
            continue;
          }
        }
        ssize_t n = ::recv(c, tmp, sizeof tmp, 0);
        if (n <= 0) break;
        buf.append(tmp, static_cast<std::size_t>(n));
      }
      ::close(c);
    }
  }

  std::function<json(const json&)> reply_;
  int fd_ = -1, port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::vector<std::pair<std::string, json>> requests_;
};

class EvalCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("lorasync-evalcli");
    auto r = run_lorasync("init-model --preset tiny --seed 2 --init-std 0.1 --output " +
                          shell_quote(model_dir().string()));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    r = run_lorasync("init-adapter --model " + shell_quote(model_dir().string()) + " --output " +
                     shell_quote((dir_->path() / "adapters" / "ad-v1").string()) +
                     " --rank 2 --b-std 0.3 --seed 4");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    write_file_atomic(data(),
                      "{\"problem\": \"What is $1+1$?\", \"answer\": \"2\"}\n"
                      "\n"
                      "{\"problem\": \"Compute $\\\\frac{1}{2}+\\\\frac{1}{3}$.\", \"answer\": \"\\\\frac{5}{6}\", \"level\": 2}\n"
                      "{\"problem\": \"How many primes are below 10?\", \"answer\": [\"4\", \"four\"]}\n"
                      "{\"problem\": \"What is $6 \\\\times 7$?\", \"answer\": 42}\n"
                      "{\"problem\": \"Solve $x+3=5$.\", \"answer\": \"2\"}\n");
  }
  static void TearDownTestSuite() { delete dir_; }
  static fs::path model_dir() { return dir_->path() / "tiny"; }
  static fs::path data() { return dir_->path() / "set.jsonl"; }
  static std::string model() { return shell_quote(model_dir().string()); }
  static std::string base_args() {
    return "eval --model " + model() + " --data " + shell_quote(data().string()) + " --threads 2";
  }
  // Runs eval; expects exit 0 and exactly one JSON line on stdout.
  static json eval_ok(const std::string& extra) {
    auto r = run_lorasync(base_args() + " " + extra);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    auto j = json::parse(r.out, nullptr, false);
    EXPECT_TRUE(j.is_object()) << r.out << r.err;
    return j;
  }
  static void expect_sane(const json& j, std::int64_t problems, std::int64_t samples,
                          std::int64_t max_new, const std::string& mode) {
    EXPECT_EQ(j["problems"], problems) << j;
    EXPECT_EQ(j["samples"], samples) << j;
    EXPECT_EQ(j["mode"], mode) << j;
    const double acc = j["accuracy"].get<double>();
    EXPECT_GE(acc, 0.0);
    EXPECT_LE(acc, 1.0);
    const auto correct = j["correct"].get<std::int64_t>();
    EXPECT_GE(correct, 0);
    EXPECT_LE(correct, problems * samples);
    EXPECT_DOUBLE_EQ(acc, static_cast<double>(correct) / static_cast<double>(problems * samples));
    EXPECT_GT(j["mean_length"].get<double>(), 0.0);
    EXPECT_LE(j["mean_length"].get<double>(), static_cast<double>(max_new));
    EXPECT_GE(j["truncated_frac"].get<double>(), 0.0);
    EXPECT_LE(j["truncated_frac"].get<double>(), 1.0);
    EXPECT_GE(j["seconds"].get<double>(), 0.0);
  }
  // The fields that depend only on what was generated (not on timing).
  static json outcome(const json& j) {
    return {j["accuracy"], j["correct"], j["mean_length"], j["truncated_frac"], j["problems"]};
  }
  static TempDir* dir_;
};
TempDir* EvalCli::dir_ = nullptr;

TEST_F(EvalCli, InProcessCountsDeterminismOutAndAdapter) {
  const fs::path out = dir_->path() / "result.json";
  const fs::path sa = dir_->path() / "a.jsonl", sb = dir_->path() / "b.jsonl";
  json a = eval_ok("--samples 2 --max-new-tokens 6 --temperature 1 --seed 5 --out " +
                   shell_quote(out.string()) + " --samples-out " + shell_quote(sa.string()));
  expect_sane(a, 5, 2, 6, "in_process");
  EXPECT_TRUE(a["adapter"].is_null());
  EXPECT_EQ(a["skipped_long"], 0);
  // --out holds the same JSON as stdout.
  EXPECT_EQ(json::parse(read_file(out)), a);
  // Same seed, same completions; the two samples of a problem differ.
  json b = eval_ok("--samples 2 --max-new-tokens 6 --temperature 1 --seed 5 --samples-out " +
                   shell_quote(sb.string()));
  EXPECT_EQ(outcome(a), outcome(b));
  EXPECT_EQ(read_file(sa), read_file(sb));
  std::istringstream lines(read_file(sa));
  std::string l0, l1;
  std::getline(lines, l0);
  std::getline(lines, l1);
  EXPECT_EQ(json::parse(l0)["sample"], 0);
  EXPECT_EQ(json::parse(l1)["sample"], 1);
  EXPECT_NE(json::parse(l0)["text"], json::parse(l1)["text"]);
  // With an adapter; --limit takes the first problems.
  json c = eval_ok("--max-new-tokens 3 --limit 2 --seed 5 --adapter " +
                   shell_quote((dir_->path() / "adapters" / "ad-v1").string()));
  expect_sane(c, 2, 1, 3, "in_process");
  EXPECT_NE(c["adapter"].get<std::string>().find("ad-v1"), std::string::npos);
  // Raw prompts and an empty system prompt are accepted.
  expect_sane(eval_ok("--max-new-tokens 2 --prompt-format raw --system-prompt '' --limit 1"), 1, 1, 2,
              "in_process");
}

TEST_F(EvalCli, ThroughServe) {
  testing::ChildProcess serve({LORASYNC_BINARY, "serve", "--model", model_dir().string(),
                               "--served-model-name", "tiny", "--port", "0", "--kv-cache-memory",
                               "32MiB", "--max-model-len", "512", "--api-key", "sekrit",
                               "--allowed-adapter-root", (dir_->path() / "adapters").string()});
  auto line = serve.read_line(60);
  ASSERT_TRUE(line) << serve.stderr_text();
  const int port = json::parse(*line)["port"].get<int>();
  const std::string url = "--server http://127.0.0.1:" + std::to_string(port);

  json s = eval_ok(url + " --served-model tiny --api-key sekrit --samples 3 --max-new-tokens 8 --seed 7");
  expect_sane(s, 5, 3, 8, "server");
  // One request at a time: the same seed gives the same outcome.
  const fs::path f1 = dir_->path() / "s1.jsonl", f2 = dir_->path() / "s2.jsonl";
  json s1 = eval_ok(url + " --served-model tiny --api-key sekrit --samples 3 --max-new-tokens 8 "
                    "--seed 7 --concurrency 1 --samples-out " + shell_quote(f1.string()));
  json s2 = eval_ok(url + " --served-model tiny --api-key sekrit --samples 3 --max-new-tokens 8 "
                    "--seed 7 --concurrency 1 --samples-out " + shell_quote(f2.string()));
  EXPECT_EQ(outcome(s1), outcome(s2));
  EXPECT_EQ(read_file(f1), read_file(f2));

  // Greedy decoding: the server and the in-process loop generate the same completions.
  const fs::path srv_samples = dir_->path() / "greedy-server.jsonl", loc_samples = dir_->path() / "greedy-local.jsonl";
  json g_srv = eval_ok(url + " --served-model tiny --api-key sekrit --temperature 0 --max-new-tokens 8 "
                       "--samples-out " + shell_quote(srv_samples.string()));
  json g_loc = eval_ok("--temperature 0 --max-new-tokens 8 --samples-out " + shell_quote(loc_samples.string()));
  EXPECT_EQ(outcome(g_srv), outcome(g_loc)) << g_srv << "\n" << g_loc;
  EXPECT_EQ(read_file(srv_samples), read_file(loc_samples));

  // Errors carry the server's reason and exit 1.
  auto r = run_lorasync(base_args() + " " + url + " --served-model tiny --max-new-tokens 4");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("401"), std::string::npos) << r.err;
  r = run_lorasync(base_args() + " " + url + " --served-model no-such-adapter --api-key sekrit --max-new-tokens 4");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("404"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no-such-adapter"), std::string::npos) << r.err;
  r = run_lorasync(base_args() + " " + url + " --served-model tiny --api-key sekrit --max-new-tokens 4000");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("400"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
}

// Grading and counting on known completions, and the request the server gets.
TEST_F(EvalCli, ServerModeGradesAndSendsTheRequest) {
  // Sample 0 answers 2 (right for problems 0 and 4), sample 1 answers 42 (right for problem 3,
  // whose answer is the JSON integer 42). Sample 0 stops after 3 tokens, sample 1 hits the limit.
  FakeUpstream fake([](const json& req) {
    json choices = json::array();
    for (int i = 0; i < req.value("n", 1); ++i)
      choices.push_back({{"index", i},
                         {"text", i == 0 ? "So the answer is \\boxed{2}." : "Hmm, \\boxed{42}"},
                         {"token_ids", i == 0 ? json{1, 2, 3} : json{1, 2, 3, 4, 5}},
                         {"finish_reason", i == 0 ? "stop" : "length"}});
    return json{{"object", "text_completion"}, {"choices", choices}};
  });
  const std::string args = "--server http://127.0.0.1:" + std::to_string(fake.port()) +
                           " --served-model policy-v3 --api-key tok --samples 2 --max-new-tokens 5 "
                           "--temperature 0.5 --seed 9 --concurrency 1";
  const fs::path per_sample = dir_->path() / "samples.jsonl";
  json j = eval_ok(args + " --samples-out " + shell_quote(per_sample.string()));
  expect_sane(j, 5, 2, 5, "server");
  EXPECT_EQ(j["correct"], 3);
  EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(j["mean_length"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(j["truncated_frac"].get<double>(), 0.5);
  EXPECT_EQ(j["served_model"], "policy-v3");

  auto reqs = fake.requests();
  ASSERT_EQ(reqs.size(), 5u);
  std::set<std::int64_t> seeds;
  for (const auto& [head, req] : reqs) {
    EXPECT_NE(head.find("POST /v1/completions HTTP/1.1"), std::string::npos) << head;
    EXPECT_NE(head.find("Authorization: Bearer tok"), std::string::npos) << head;
    EXPECT_EQ(req["model"], "policy-v3");
    ASSERT_TRUE(req["prompt"].is_array());
    EXPECT_EQ(req["prompt"][0], 151644);  // <|im_start|>, no BOS
    EXPECT_EQ(req["n"], 2);
    EXPECT_EQ(req["max_tokens"], 5);
    EXPECT_EQ(req["temperature"], 0.5);
    EXPECT_EQ(req["top_p"], 1);
    EXPECT_EQ(req["return_token_ids"], true);
    const auto stops = req["stop_token_ids"].get<std::vector<std::int64_t>>();
    EXPECT_NE(std::find(stops.begin(), stops.end(), 151645), stops.end()) << req;  // <|im_end|>
    seeds.insert(req["seed"].get<std::int64_t>());
  }
  EXPECT_EQ(seeds.size(), 5u);  // one seed per problem

  // Every completion with its verdict, in (problem, sample) order.
  std::istringstream lines(read_file(per_sample));
  std::string line;
  std::vector<json> recs;
  while (std::getline(lines, line)) recs.push_back(json::parse(line));
  ASSERT_EQ(recs.size(), 10u);
  EXPECT_EQ(recs[0]["index"], 0);
  EXPECT_EQ(recs[0]["sample"], 0);
  EXPECT_EQ(recs[0]["correct"], true);
  EXPECT_EQ(recs[0]["extracted"], "2");
  EXPECT_EQ(recs[1]["correct"], false);
  EXPECT_EQ(recs[7]["correct"], true);  // problem 3, sample 1: 42
  EXPECT_EQ(recs[7]["finish_reason"], "length");

  // The same seed sends the same seeds again.
  auto r = run_lorasync(base_args() + " " + args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  reqs = fake.requests();
  ASSERT_EQ(reqs.size(), 10u);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(reqs[i].second["seed"], reqs[i + 5].second["seed"]);
}

TEST_F(EvalCli, Errors) {
  // A row without its answer: exit 1 naming the file, the line and the field.
  const fs::path bad = dir_->path() / "bad.jsonl";
  write_file_atomic(bad, "{\"problem\": \"a\", \"answer\": \"1\"}\n\n{\"problem\": \"b\"}\n");
  auto r = run_lorasync("eval --model " + model() + " --data " + shell_quote(bad.string()) +
                        " --max-new-tokens 2");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("bad.jsonl line 3: missing field 'answer' (--answer-key)"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
  // Another key name finds nothing.
  r = run_lorasync(base_args() + " --problem-key question --max-new-tokens 2");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("line 1: missing field 'question' (--problem-key)"), std::string::npos) << r.err;
  // A missing data file.
  r = run_lorasync("eval --model " + model() + " --data " +
                   shell_quote((dir_->path() / "nope.jsonl").string()));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("nope.jsonl"), std::string::npos) << r.err;
  // Nothing listens on the port.
  r = run_lorasync(base_args() + " --server http://127.0.0.1:1 --max-new-tokens 2");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("cannot reach server"), std::string::npos) << r.err;
  // Bad flags: exit 2.
  for (const char* flags : {"--samples 0", "--max-new-tokens 0", "--temperature -1", "--limit -1",
                            "--prompt-format alpaca", "--server not-a-url",
                            "--server http://127.0.0.1:1 --adapter x", "--served-model x",
                            "--concurrency 0", "--bogus-flag"}) {
    r = run_lorasync(base_args() + " " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.err;
  }
  r = run_lorasync("eval --model " + model());  // --data missing
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

}  // namespace
}  // namespace lorasync
