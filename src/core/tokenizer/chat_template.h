// core/tokenizer/chat_template.h: the Qwen ChatML chat template.
//
//   <|im_start|>{role}\n{content}<|im_end|>\n   for each message, then, with
//   add_generation_prompt, <|im_start|>assistant\n
// This is the string Qwen2/Qwen2.5(-Math)'s Jinja template renders for plain system / user /
// assistant messages (no tools); the server's chat endpoint and the trainer's prompt builder both
// use it, then tokenize with parse_special = true so the markers become single ids. No default
// system message is inserted: callers pass the one they want.
// Thread-safety: pure functions.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace lorasync::tok {

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;  // the message text
};

// InvalidInput naming messages[i].role for another role.
std::string render_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt);

// The trainer's `chatml` prompt: an optional system message (skipped when empty), the user
// message, and the generation prompt.
std::string chatml_prompt(std::string_view system_prompt, std::string_view user);

// The same template in Jinja, for tokenizer_config.json files this project writes.
extern const char kChatmlJinja[];

}  // namespace lorasync::tok
