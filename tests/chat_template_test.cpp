// Chat templates render as jinja2 renders them (transformers' settings), and
// the assistant's text, only it, is marked as targets.
//
// tests/fixtures/chat_templates/ holds the real templates (Llama 3 and 3.1,
// Qwen2.5, Qwen3, Mistral 7B v0.1 and v0.3, Llama 2, ChatML) and cases.json: conversations and
// small one-construct templates with jinja2's rendering of each, written by
// tests/chat_template_compare.py --write-fixtures (which also compares
// random conversations through tests/drivers/chat_template_render).
#include "prep/chat_template.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

using ordered = nlohmann::ordered_json;

const std::string kFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/chat_templates/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot read " << path;
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

ChatTemplate load(const std::string& name) {
  auto parsed = ChatTemplate::parse(read_file(kFixtures + name + ".jinja"));
  if (!parsed) ADD_FAILURE() << name << ": " << parsed.status().message();
  return std::move(parsed).value();
}

std::string joined(const std::vector<ChatPiece>& pieces) {
  std::string text;
  for (const auto& piece : pieces) text += piece.text;
  return text;
}

std::vector<std::string> targets(const std::vector<ChatPiece>& pieces) {
  std::vector<std::string> out;
  for (const auto& piece : pieces)
    if (piece.target) out.push_back(piece.text);
  return out;
}

ChatTemplateContext context_for(const std::string& bos, const std::string& eos,
                                bool prompt = false) {
  ChatTemplateContext context;
  context.bos_token = bos;
  context.eos_token = eos;
  context.add_generation_prompt = prompt;
  return context;
}

const ordered kChat = ordered::parse(R"([
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Hi"},
  {"role": "assistant", "content": "Hello!"},
  {"role": "user", "content": "Bye"},
  {"role": "assistant", "content": "Ciao"}
])");

TEST(ChatTemplate, RendersEveryFixtureExactlyAsJinja2Does) {
  ordered cases = ordered::parse(read_file(kFixtures + "cases.json"));
  ASSERT_GE(cases.size(), 50u);
  int compared = 0;
  for (const auto& c : cases) {
    std::string name = c["name"];
    std::string source = c.contains("source")
                             ? c["source"].get<std::string>()
                             : read_file(kFixtures + c["template"].get<std::string>() + ".jinja");
    auto parsed = ChatTemplate::parse(source);
    ASSERT_TRUE(parsed) << name << ": " << parsed.status().message();
    ChatTemplateContext context =
        context_for(c["bos_token"], c["eos_token"], c["add_generation_prompt"]);
    std::optional<ordered> tools;
    if (c.contains("tools")) tools = c["tools"];
    auto pieces = parsed->render(c["messages"], context, tools);
    if (c.contains("expected")) {
      ASSERT_TRUE(pieces) << name << ": " << pieces.status().message();
      EXPECT_EQ(joined(*pieces), c["expected"].get<std::string>()) << name;
      for (size_t k = 1; k < pieces->size(); ++k)
        EXPECT_NE((*pieces)[k - 1].target, (*pieces)[k].target)
            << name << ": pieces are not merged";
    } else {
      ASSERT_FALSE(pieces) << name << ": rendered although jinja2 raised";
      const std::string& message = pieces.status().message();
      EXPECT_NE(message.find(c["expected_error"].get<std::string>()), std::string::npos)
          << name << ": " << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << name << ": one line";
    }
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(cases.size()));
}

TEST(ChatTemplate, ChatmlTargetsTheRepliesAndTheirEndOfTurn) {
  auto pieces = load("chatml").render(kChat, context_for("", "<|im_end|>"));
  ASSERT_TRUE(pieces) << pieces.status().message();
  ASSERT_EQ(pieces->size(), 5u);
  EXPECT_EQ((*pieces)[0].text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_FALSE((*pieces)[0].target);
  EXPECT_EQ((*pieces)[1].text, "Hello!<|im_end|>");
  EXPECT_TRUE((*pieces)[1].target);
  EXPECT_EQ((*pieces)[2].text, "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ((*pieces)[3].text, "Ciao<|im_end|>");
  EXPECT_TRUE((*pieces)[3].target);
  EXPECT_EQ((*pieces)[4].text, "\n");
  EXPECT_FALSE((*pieces)[4].target);
}

TEST(ChatTemplate, LlamaTargetsStartAfterTheAssistantHeader) {
  for (const char* name : {"llama3", "llama3.1"}) {
    auto pieces = load(name).render(kChat, context_for("<|begin_of_text|>", "<|eot_id|>", true));
    ASSERT_TRUE(pieces) << pieces.status().message();
    EXPECT_EQ(targets(*pieces), (std::vector<std::string>{"Hello!<|eot_id|>", "Ciao<|eot_id|>"}))
        << name;
    // The generation prompt is a header: not a target.
    EXPECT_FALSE(pieces->back().target);
    const std::string header = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    ASSERT_GE(pieces->back().text.size(), header.size());
    EXPECT_EQ(pieces->back().text.substr(pieces->back().text.size() - header.size()), header);
  }
}

TEST(ChatTemplate, ToolCallsAreTargetsAndToolResultsAreNot) {
  ordered chat = ordered::parse(R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "21"},
    {"role": "assistant", "content": "21 degrees."}
  ])");
  ordered tools = ordered::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  auto qwen = load("qwen2.5").render(chat, context_for("", "<|im_end|>"), tools);
  ASSERT_TRUE(qwen) << qwen.status().message();
  EXPECT_EQ(targets(*qwen),
            (std::vector<std::string>{
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                "</tool_call><|im_end|>",
                "21 degrees.<|im_end|>"}));
  EXPECT_NE(joined(*qwen).find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": "
                               "\"get_weather\", \"parameters\""),
            std::string::npos)
      << "tools keep their key order";

  auto llama = load("llama3.1").render(chat, context_for("<|begin_of_text|>", "<|eot_id|>"), tools);
  ASSERT_TRUE(llama) << llama.status().message();
  EXPECT_EQ(targets(*llama),
            (std::vector<std::string>{
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>",
                "21 degrees.<|eot_id|>"}));
}

TEST(ChatTemplate, Qwen3ThinkingIsPartOfTheTarget) {
  ordered chat = ordered::parse(R"([
    {"role": "user", "content": "Is 97 prime?"},
    {"role": "assistant", "content": "<think>\nCheck 2, 3, 5, 7.\n</think>\n\nYes."}
  ])");
  auto pieces = load("qwen3").render(chat, context_for("", "<|im_end|>"));
  ASSERT_TRUE(pieces) << pieces.status().message();
  EXPECT_EQ(targets(*pieces),
            (std::vector<std::string>{"<think>\nCheck 2, 3, 5, 7.\n</think>\n\nYes.<|im_end|>"}));
}

TEST(ChatTemplate, MistralTargetsTheReplyWithItsLeadingSpaceAndEos) {
  auto pieces = load("mistral-v0.1").render(kChat, context_for("<s>", "</s>"));
  ASSERT_TRUE(pieces) << pieces.status().message();
  EXPECT_EQ(joined(*pieces),
            "<s> [INST] Be brief.\n\nHi [/INST] Hello!</s> [INST] Bye [/INST] Ciao</s>");
  EXPECT_EQ(targets(*pieces), (std::vector<std::string>{" Hello!</s>", " Ciao</s>"}));
}

TEST(ChatTemplate, Llama2PutsTheSystemPromptInTheFirstTurnAndTargetsTheReplies) {
  auto pieces = load("llama2").render(kChat, context_for("<s>", "</s>"));
  ASSERT_TRUE(pieces) << pieces.status().message();
  EXPECT_EQ(joined(*pieces),
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST] "
            "Ciao </s>");
  EXPECT_EQ(targets(*pieces), (std::vector<std::string>{" Hello! </s>", " Ciao </s>"}));
}

TEST(ChatTemplate, GenerationTagsDecideTheTargetsWhenPresent) {
  auto parsed = ChatTemplate::parse(
      "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
      "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}");
  ASSERT_TRUE(parsed) << parsed.status().message();
  auto pieces = parsed->render(kChat, context_for("", ""));
  ASSERT_TRUE(pieces) << pieces.status().message();
  EXPECT_EQ(targets(*pieces), (std::vector<std::string>{"Hello!", "Ciao"}));
}

TEST(ChatTemplate, RefusesToGuessTargetsWhenNoLoopVisitsTheMessages) {
  auto parsed = ChatTemplate::parse(
      "{% for i in range(messages|length) %}{{ messages[i].role }}: {{ messages[i].content }}\n"
      "{% endfor %}");
  ASSERT_TRUE(parsed) << parsed.status().message();
  auto pieces = parsed->render(kChat, context_for("", ""));
  ASSERT_FALSE(pieces);
  EXPECT_NE(pieces.status().message().find("{% generation %}"), std::string::npos)
      << pieces.status().message();
  // Without an assistant message there is nothing to attribute: it renders.
  auto prompt_only =
      parsed->render(ordered::parse(R"([{"role": "user", "content": "x"}])"), context_for("", ""));
  ASSERT_TRUE(prompt_only) << prompt_only.status().message();
  EXPECT_EQ(joined(*prompt_only), "user: x\n");
}

TEST(ChatTemplate, SortedAndOrderedJsonRenderTheSameWhenKeysAreSorted) {
  nlohmann::json sorted = nlohmann::json::parse(R"([{"content": "Hi", "role": "user"},
                                                     {"content": "Yo", "role": "assistant"}])");
  ChatTemplate chatml = load("chatml");
  auto plain = chatml.render(sorted, context_for("", ""));
  auto kept = chatml.render(ordered::parse(sorted.dump()), context_for("", ""));
  ASSERT_TRUE(plain && kept);
  EXPECT_EQ(joined(*plain), joined(*kept));
  EXPECT_EQ(targets(*plain), targets(*kept));
}

TEST(ChatTemplate, RefusesUnsupportedConstructsNamingTheLine) {
  struct Case {
    const char* source;
    const char* expected;
  };
  const Case cases[] = {
      {"a\n\n{% macro greet(x) %}{{ x }}{% endmacro %}", "line 3: unsupported tag '{% macro %}'"},
      {"{% for m in messages %}\n{{ m.content | wordwrap }}{% endfor %}",
       "line 2: unsupported filter 'wordwrap'"},
      {"{{ x is escaped }}", "line 1: unsupported test 'escaped'"},
      {"{% include 'other.jinja' %}", "line 1: unsupported tag '{% include %}'"},
      {"{% set x %}block{% endset %}", "line 1: unsupported: '{% set x %}...{% endset %}' blocks"},
      {"{% for x in y recursive %}{% endfor %}", "line 1: unsupported: recursive for loops"},
  };
  for (const Case& c : cases) {
    auto parsed = ChatTemplate::parse(c.source);
    ASSERT_FALSE(parsed) << c.source;
    EXPECT_NE(parsed.status().message().find(c.expected), std::string::npos)
        << parsed.status().message();
    EXPECT_EQ(parsed.status().message().rfind("chat template line ", 0), 0u);
  }
}

TEST(ChatTemplate, RefusesMalformedTemplatesNamingTheLine) {
  struct Case {
    const char* source;
    const char* expected;
  };
  const Case cases[] = {
      {"{% if x %}\nno end", "expected '{% endif %}'"},
      {"text\n{{ x ", "line 2: {{ is never closed with }}"},
      {"{% endfor %}", "line 1: unexpected '{% endfor %}'"},
      {"{{ 'abc }}", "line 1: string literal is never closed"},
      {"\n{# open comment", "line 2: comment {# is never closed with #}"},
      {"{{ 1 + }}", "line 1: expected an expression, found '}}'"},
      {"{% if %}{% endif %}", "line 1: expected an expression, found '%}'"},
      {"{% break %}", "line 1: 'break' outside a for loop"},
      {"{% for x y %}{% endfor %}", "line 1: expected 'in' in the for loop"},
  };
  for (const Case& c : cases) {
    auto parsed = ChatTemplate::parse(c.source);
    ASSERT_FALSE(parsed) << c.source;
    EXPECT_NE(parsed.status().message().find(c.expected), std::string::npos)
        << parsed.status().message();
  }
}

TEST(ChatTemplate, RenderErrorsAreOneLineNamingTheTemplateLine) {
  auto mistral = load("mistral-v0.1");
  auto refused = mistral.render(ordered::parse(R"([{"role": "assistant", "content": "x"}])"),
                                context_for("<s>", "</s>"));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find(
                "line 11: the template refused the conversation: After the optional system "
                "message, conversation roles must alternate user/assistant/user/assistant/..."),
            std::string::npos)
      << refused.status().message();

  auto chatml = load("chatml");
  // chatml.jinja's strings hold newlines: its `+` after message['content'] is on line 2.
  auto missing = chatml.render(ordered::parse(R"([{"role": "user"}])"), context_for("", ""));
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("line 2: undefined value in '+'"), std::string::npos)
      << missing.status().message();

  auto not_a_list = chatml.render(ordered::parse(R"({"role": "user"})"), context_for("", ""));
  ASSERT_FALSE(not_a_list);
  EXPECT_NE(not_a_list.status().message().find("must be a JSON array"), std::string::npos);

  auto not_objects = chatml.render(ordered::parse(R"(["hi"])"), context_for("", ""));
  ASSERT_FALSE(not_objects);
  EXPECT_NE(not_objects.status().message().find("message 0 is not a JSON object"),
            std::string::npos);

  auto attribute = ChatTemplate::parse("{{ nothing.role }}");
  ASSERT_TRUE(attribute);
  auto undefined = attribute->render(kChat, context_for("", ""));
  ASSERT_FALSE(undefined);
  EXPECT_NE(undefined.status().message().find("line 1: 'role' of an undefined value"),
            std::string::npos)
      << undefined.status().message();
}

// One ChatTemplate rendered from several threads at once (the assistant
// header computed for new tokens on the way) gives what one thread gives.
TEST(ChatTemplate, ConcurrentRendersMatchOneThread) {
  ChatTemplate qwen = load("qwen3");
  auto expected = qwen.render(kChat, context_for("", "<|im_end|>"));
  ASSERT_TRUE(expected) << expected.status().message();
  std::vector<std::thread> threads;
  std::vector<int> mismatches(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 200; ++k) {
        // Tokens unseen before make the threads fill the header cache together.
        std::string bos = "<bos" + std::to_string((t * 200 + k) % 16) + ">";
        auto pieces = qwen.render(kChat, context_for(k % 2 ? bos : "", "<|im_end|>"));
        if (!pieces || joined(*pieces) != joined(*expected) ||
            targets(*pieces) != targets(*expected))
          ++mismatches[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

// Mutated templates (characters of the syntax deleted, inserted, swapped)
// either render or come back as one-line errors: nothing throws or crashes.
TEST(ChatTemplate, MutatedTemplatesRenderOrFailInOneLine) {
  uint64_t seed = std::random_device{}();
  if (const char* fixed = std::getenv("STRATA_TEST_SEED")) seed = std::strtoull(fixed, nullptr, 10);
  std::cout << "seed " << seed << " (STRATA_TEST_SEED reruns it)\n";
  std::mt19937_64 rng(seed);
  const std::string alphabet = "{}%#-+()[]'\"|.,:=~*/ \nabcnotinis0123456789";
  int rendered = 0, refused = 0;
  for (const char* name : {"chatml", "llama2", "llama3", "llama3.1", "mistral-v0.1", "mistral-v0.3",
                           "qwen2.5", "qwen3"}) {
    const std::string original = read_file(kFixtures + name + ".jinja");
    for (int trial = 0; trial < 300; ++trial) {
      std::string source = original;
      int edits = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < edits && !source.empty(); ++k) {
        size_t at = rng() % source.size();
        switch (rng() % 3) {
          case 0:
            source.erase(at, 1 + rng() % 3);
            break;
          case 1:
            source.insert(at, 1, alphabet[rng() % alphabet.size()]);
            break;
          default:
            source[at] = alphabet[rng() % alphabet.size()];
        }
      }
      Result<ChatTemplate> parsed = Status::error("not parsed");
      ASSERT_NO_THROW(parsed = ChatTemplate::parse(source)) << name << " trial " << trial;
      if (!parsed) {
        ++refused;
        EXPECT_EQ(parsed.status().message().find('\n'), std::string::npos)
            << parsed.status().message();
        continue;
      }
      Result<std::vector<ChatPiece>> pieces = Status::error("not rendered");
      ASSERT_NO_THROW(pieces = parsed->render(kChat, context_for("<s>", "</s>", trial % 2 == 0)))
          << name << " trial " << trial;
      if (pieces) {
        ++rendered;
      } else {
        ++refused;
        EXPECT_EQ(pieces.status().message().find('\n'), std::string::npos)
            << pieces.status().message();
      }
    }
  }
  std::cout << rendered << " mutated templates rendered, " << refused << " refused\n";
  EXPECT_GT(refused, 0);
}

TEST(ChatTemplate, RefusesNestingDeeperThanAnyChatTemplate) {
  std::string deep = "{{ " + std::string(500, '(') + "1" + std::string(500, ')') + " }}";
  auto parsed = ChatTemplate::parse(deep);
  ASSERT_FALSE(parsed);
  EXPECT_NE(parsed.status().message().find("nested more than 200 deep"), std::string::npos);
  std::string blocks;
  for (int k = 0; k < 300; ++k) blocks += "{% if true %}";
  for (int k = 0; k < 300; ++k) blocks += "{% endif %}";
  EXPECT_FALSE(ChatTemplate::parse(blocks));
  auto overflow = ChatTemplate::parse("{{ 2 ** 70 }}");
  ASSERT_TRUE(overflow);
  auto result = overflow->render(kChat, context_for("", ""));
  ASSERT_FALSE(result);
  EXPECT_NE(result.status().message().find("integer overflow"), std::string::npos);
}

}  // namespace
}  // namespace strata
