// core/tokenizer/chat_template.cpp
#include "core/tokenizer/chat_template.h"

#include <vector>

#include "util/error.h"

namespace lorasync::tok {

const char kChatmlJinja[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
    "}}{% endif %}";

std::string render_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  std::string out;
  std::size_t n = 32;
  for (const auto& m : messages) n += m.role.size() + m.content.size() + 24;
  out.reserve(n);
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      throw Error(ErrorKind::kInvalidInput,
                  fmt::format("messages[{}].role: {:?} is not one of system, user, assistant", i,
                              m.role),
                  fmt::format("messages[{}].role", i));
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
