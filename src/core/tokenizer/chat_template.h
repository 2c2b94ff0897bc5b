// core/tokenizer/chat_template.h: the chat templates lorasync renders, and which one a tokenizer
// asks for.
//
// ChatML (Qwen2, Qwen2.5), as below; Qwen3's (ChatML with <think> blocks) and Llama 3's header
// format are under render_chat.
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

// The formats render_chat writes, for plain system / user / assistant messages (no tools):
//  - kChatml: render_chatml.
//  - kQwen3: ChatML as Qwen3's template renders it. An assistant message's "<think>...</think>"
//    block is split off its content and kept only for the assistant turns after the last user
//    message (earlier turns' thinking is stripped, as the template does); the generation prompt
//    with enable_thinking false is "<|im_start|>assistant\n<think>\n\n</think>\n\n".
//  - kLlama3: "<|begin_of_text|>" then "<|start_header_id|>{role}<|end_header_id|>\n\n{content,
//    trimmed}<|eot_id|>" per message, then with add_generation_prompt
//    "<|start_header_id|>assistant<|end_header_id|>\n\n". No default system message (3.1's
//    knowledge-date header) is inserted: callers pass the one they want.
// Multi-turn episodes never re-render earlier turns (token-in/token-out, rl/episode.h): these
// renderings make a prompt, or a chat request's prompt.
enum class ChatFormat { kChatml, kQwen3, kLlama3 };
const char* chat_format_name(ChatFormat f);  // "chatml", "qwen3", "llama3"
// InvalidInput naming `setting` and the known formats otherwise.
ChatFormat parse_chat_format(std::string_view name, std::string_view setting);
// The format a tokenizer_config.json's chat_template (its text) asks for: llama3 for a template
// with <|start_header_id|>, qwen3 for a ChatML one with <think> blocks, chatml otherwise (and for
// an empty template).
ChatFormat detect_chat_format(std::string_view chat_template);
// detect_chat_format of <dir>/tokenizer_config.json's chat_template (a string, or the "default"
// entry of a list of {name, template}); chatml when the file or the key is absent. InvalidInput
// when the file is not JSON.
ChatFormat chat_format_of_dir(const std::string& dir);

struct ChatOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;  // kQwen3 only: false pre-fills an empty <think> block
};
std::string render_chat(ChatFormat f, std::span<const ChatMessage> messages, const ChatOptions& o = {});
// The format's end-of-turn tokens (stop tokens for a chat request).
std::span<const std::string_view> chat_stop_tokens(ChatFormat f);

}  // namespace lorasync::tok
