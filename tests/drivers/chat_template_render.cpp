// Renders conversations with a chat template, for tests/chat_template_compare.py.
//
//   chat_template_render TEMPLATE < cases.jsonl > rendered.jsonl
//
// Each input line is {"messages": [...], "tools": [...] (optional),
// "add_generation_prompt": bool, "bos_token": str, "eos_token": str}; each
// output line is {"text": the rendering, "targets": [the target pieces' text]}
// or {"error": the one-line error}. A template that does not parse is one
// line on stderr and exit status 1.
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "prep/chat_template.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: chat_template_render TEMPLATE < cases.jsonl\n";
    return 2;
  }
  std::ifstream file(argv[1], std::ios::binary);
  if (!file) {
    std::cerr << "cannot read " << argv[1] << "\n";
    return 1;
  }
  std::string source((std::istreambuf_iterator<char>(file)), {});
  auto parsed = strata::ChatTemplate::parse(source);
  if (!parsed) {
    std::cerr << argv[1] << ": " << parsed.status().message() << "\n";
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    auto input = nlohmann::ordered_json::parse(line);
    strata::ChatTemplateContext context;
    context.bos_token = input.value("bos_token", "");
    context.eos_token = input.value("eos_token", "");
    context.add_generation_prompt = input.value("add_generation_prompt", false);
    std::optional<nlohmann::ordered_json> tools;
    if (input.contains("tools")) tools = input["tools"];
    auto pieces = parsed->render(input["messages"], context, tools);
    nlohmann::ordered_json output;
    if (!pieces) {
      output["error"] = pieces.status().message();
    } else {
      std::string text;
      nlohmann::ordered_json targets = nlohmann::ordered_json::array();
      for (const auto& piece : *pieces) {
        text += piece.text;
        if (piece.target) targets.push_back(piece.text);
      }
      output["text"] = text;
      output["targets"] = targets;
    }
    std::cout << output.dump() << "\n";
  }
  return 0;
}
