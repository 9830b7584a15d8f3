#!/usr/bin/env python3
"""The two Python ends of tools/finetune-example, in a virtual environment with
PyPI transformers and tokenizers:

  make DIR   writes DIR/model: a small random Qwen2 model as Hugging Face
             writes one (config.json, model.safetensors) with a byte-level BPE
             tokenizer of the Qwen2 kind trained on the example's text
             (tokenizer.json, tokenizer_config.json with a ChatML chat
             template), and DIR/chats.jsonl: conversations to fine-tune on
             ({"messages": [...]} per line; the assistant answers a question
             about the sum of two numbers).
  check DIR  loads DIR/finetuned (what `strata train --export` wrote, with the
             tokenizer copied beside it) with transformers, computes the loss
             of held-out conversations on the assistant's tokens, and
             compares it with the random model's: fine-tuning must have
             lowered it.
"""
import json
import os
import random
import sys

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def conversation(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"messages": [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
    ]}


def make(out):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    import torch

    rng = random.Random(7)
    chats = [conversation(rng) for _ in range(3000)]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "chats.jsonl"), "w") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    held_out = [conversation(random.Random(1000 + i)) for i in range(64)]
    with open(os.path.join(out, "held_out.jsonl"), "w") as f:
        for chat in held_out:
            f.write(json.dumps(chat) + "\n")

    model_dir = os.path.join(out, "model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for c in chats for m in c["messages"]] + ["system", "user", "assistant"]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(model_dir)

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, use_sliding_window=False)
    Qwen2ForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    print(f"wrote {model_dir} (Qwen2, {sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())} "
          f"parameters, vocabulary {tok.get_vocab_size()}) and {len(chats)} conversations")


def assistant_loss(model_dir, tokenizer_dir, chats):
    """Mean cross-entropy of the assistant's answer tokens (after its header) over the chats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for chat in chats:
        prompt = tokenizer.apply_chat_template(chat["messages"][:-1], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        full = tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=False)
        ids = torch.tensor([list(full)])
        with torch.no_grad():
            logits = model(ids).logits[0]
        targets = ids[0, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="none")
        answer = losses[len(prompt) - 1:]
        total += float(answer.sum())
        count += answer.numel()
    return total / count, type(model).__name__


def check(out):
    chats = [json.loads(line) for line in open(os.path.join(out, "held_out.jsonl"))]
    before, _ = assistant_loss(os.path.join(out, "model"), os.path.join(out, "model"), chats)
    after, kind = assistant_loss(os.path.join(out, "finetuned"), os.path.join(out, "model"), chats)
    print(f"transformers loads the fine-tuned model as {kind}; held-out answer loss "
          f"{before:.3f} (random model) -> {after:.3f} (fine-tuned)")
    if not after < before:
        print("the fine-tuned model is not better on held-out answers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(make(sys.argv[2]) or 0 if sys.argv[1] == "make" else check(sys.argv[2]))
