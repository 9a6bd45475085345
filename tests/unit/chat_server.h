// A `kestrel serve` in process, over HTTP on a free port, on the qwen3-chat fixture (Qwen3's
// template over a tiny random model), for the tests of the chat endpoints: the engine on the CPU
// slots unless a test's fixture makes its own (make_slots), restartable with another template or
// speculation.
#pragma once
#include <gtest/gtest.h>
#include <httplib.h>

#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "fixture.h"
#include "model/weights.h"
#include "runtime/engine.h"
#include "server/http_server.h"
#include "text/model_chat.h"
#include "text/tokenizer.h"

namespace kestrel::server {

class ChatServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::fixture_dir("qwen3-chat");
    model_ = load_model(dir_);
    tok_ = std::make_unique<text::Tokenizer>(text::Tokenizer::from_file(dir_ + "/tokenizer.json"));
    start(text::load_model_chat(*model_, dir_));
  }
  void TearDown() override { stop(); }

  // The engine's slots (null: the engine's own CPU slots).
  virtual std::unique_ptr<SequenceSlots> make_slots(const EngineOptions&) { return nullptr; }

  void start(text::ModelChat chat) {
    EngineOptions eo;
    eo.max_batch = 4;
    eo.context = 2048;
    eo.kv_tokens = 4 * 2048;
    eo.threads = 1;
    eo.speculation = speculation_;
    engine_ = std::make_unique<Engine>(*model_, eo, make_slots(eo));
    ServerOptions so;
    so.port = 0;
    so.model_name = "qwen3-chat";
    server_ = std::make_unique<HttpServer>(*engine_, *tok_, std::move(chat), so);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->serve(); });
  }
  void stop() {
    server_->stop();
    thread_.join();
    engine_->shutdown(0);
    server_.reset();
    engine_.reset();
  }

  // POST to `path`: (status, body), status -1 when the request failed.
  std::pair<int, std::string> post(const std::string& body, const char* path = "/v1/chat/completions") {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(120);
    auto r = cli.Post(path, body, "application/json");
    if (!r) return {-1, httplib::to_string(r.error())};
    return {r->status, r->body};
  }
  // The same, expecting 200: the parsed reply.
  json ok(const std::string& body, const char* path = "/v1/chat/completions") {
    const auto [status, text] = post(body, path);
    EXPECT_EQ(status, 200) << text;
    return json::parse(text, nullptr, false);
  }

  std::string dir_;
  SpeculationOptions speculation_;  // the engine's, from the next start()
  std::unique_ptr<Model> model_;
  std::unique_ptr<text::Tokenizer> tok_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace kestrel::server
