// core/tokenizer/chat_template.cpp
#include "core/tokenizer/chat_template.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <vector>

#include "util/error.h"
#include "util/files.h"

namespace lorasync::tok {

const char kChatmlJinja[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
    "}}{% endif %}";

namespace {

void check_roles(std::span<const ChatMessage> messages) {
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      throw Error(ErrorKind::kInvalidInput,
                  fmt::format("messages[{}].role: {:?} is not one of system, user, assistant", i, m.role),
                  fmt::format("messages[{}].role", i));
  }
}

std::string_view strip_ws(std::string_view s, bool left, bool right) {
  auto ws = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; };
  while (left && !s.empty() && ws(s.front())) s.remove_prefix(1);
  while (right && !s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

std::string_view strip_newlines(std::string_view s, bool left, bool right) {
  while (left && !s.empty() && s.front() == '\n') s.remove_prefix(1);
  while (right && !s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

std::string render_qwen3(std::span<const ChatMessage> messages, const ChatOptions& o) {
  // The last user message: assistant turns after it keep their thinking (none without one).
  std::size_t last_query = messages.empty() ? 0 : messages.size() - 1;
  for (std::size_t i = messages.size(); i-- > 0;)
    if (messages[i].role == "user") {
      last_query = i;
      break;
    }
  std::string out;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    if (m.role != "assistant") {
      out += m.content;
    } else {
      std::string_view content = m.content, reasoning;
      if (const auto end = content.find("</think>"); end != std::string_view::npos) {
        std::string_view before = content.substr(0, end);
        if (const auto start = before.rfind("<think>"); start != std::string_view::npos)
          before = before.substr(start + 7);
        reasoning = strip_newlines(strip_newlines(before, false, true), true, false);
        content = strip_newlines(content.substr(content.rfind("</think>") + 8), true, false);
      }
      const bool keep = i > last_query && (i + 1 == messages.size() || !reasoning.empty());
      if (keep) {
        out += "<think>\n";
        out += reasoning;
        out += "\n</think>\n\n";
      }
      out += content;
    }
    out += "<|im_end|>\n";
  }
  if (o.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (!o.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

std::string render_llama3(std::span<const ChatMessage> messages, const ChatOptions& o) {
  std::string out = "<|begin_of_text|>";
  for (const auto& m : messages) {
    out += "<|start_header_id|>";
    out += m.role;
    out += "<|end_header_id|>\n\n";
    out += strip_ws(m.content, true, true);
    out += "<|eot_id|>";
  }
  if (o.add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

}  // namespace

const char* chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::kChatml: return "chatml";
    case ChatFormat::kQwen3: return "qwen3";
    case ChatFormat::kLlama3: return "llama3";
  }
  return "?";
}

ChatFormat parse_chat_format(std::string_view name, std::string_view setting) {
  if (name == "chatml") return ChatFormat::kChatml;
  if (name == "qwen3") return ChatFormat::kQwen3;
  if (name == "llama3") return ChatFormat::kLlama3;
  throw_invalid("{} = {:?} is not one of chatml, qwen3, llama3", setting, name);
}

ChatFormat detect_chat_format(std::string_view t) {
  if (t.find("<|start_header_id|>") != std::string_view::npos) return ChatFormat::kLlama3;
  if (t.find("<|im_start|>") != std::string_view::npos && t.find("<think>") != std::string_view::npos)
    return ChatFormat::kQwen3;
  return ChatFormat::kChatml;
}

ChatFormat chat_format_of_dir(const std::string& dir) {
  const auto path = std::filesystem::path(dir) / "tokenizer_config.json";
  if (!std::filesystem::exists(path)) return ChatFormat::kChatml;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw_invalid("{}: not valid JSON: {}", path.string(), e.what());
  }
  if (!j.is_object() || !j.contains("chat_template")) return ChatFormat::kChatml;
  const auto& t = j["chat_template"];
  if (t.is_string()) return detect_chat_format(t.get<std::string>());
  if (t.is_array())
    for (const auto& e : t)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
        return detect_chat_format(e["template"].get<std::string>());
  return ChatFormat::kChatml;
}

std::string render_chat(ChatFormat f, std::span<const ChatMessage> messages, const ChatOptions& o) {
  check_roles(messages);
  switch (f) {
    case ChatFormat::kQwen3: return render_qwen3(messages, o);
    case ChatFormat::kLlama3: return render_llama3(messages, o);
    case ChatFormat::kChatml: break;
  }
  return render_chatml(messages, o.add_generation_prompt);
}

std::span<const std::string_view> chat_stop_tokens(ChatFormat f) {
  static constexpr std::string_view kChatmlStops[] = {"<|im_end|>", "<|endoftext|>"};
  static constexpr std::string_view kLlama3Stops[] = {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"};
  if (f == ChatFormat::kLlama3) return kLlama3Stops;
  return kChatmlStops;
}

std::string render_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  std::string out;
  std::size_t n = 32;
  for (const auto& m : messages) n += m.role.size() + m.content.size() + 24;
  out.reserve(n);
  check_roles(messages);
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    out += m.content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

std::string chatml_prompt(std::string_view system_prompt, std::string_view user) {
  std::vector<ChatMessage> msgs;
  if (!system_prompt.empty()) msgs.push_back({"system", std::string(system_prompt)});
  msgs.push_back({"user", std::string(user)});
  return render_chatml(msgs, true);
}

}  // namespace lorasync::tok
