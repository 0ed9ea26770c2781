"""Models a user brings, through `make serve`'s stack (Triton, gRPC, HTTP) and the openai SDK
(issue "Any model a user brings"): a GGUF file of K-quant blocks, served from its own blocks,
whose metadata has a tokenizer but no chat template (completions are served; chat is a 400
that says so); and a Hugging Face folder of an architecture our own forward does not take
(Gemma 2: sliding windows, soft-capping), served on the transformers path with the default
model's tokenizer and chat template, its greedy tokens transformers' own."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.helpers.gguf_files import write_model

pytestmark = pytest.mark.e2e

MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # fmt: skip


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    from launcher import Stack
    from launcher.layout import default_model_path

    path = write_model(tmp_path_factory.mktemp("gguf") / "tiny-k.Q4_K_M.gguf", [MIXED, "Q5_0", "Q6_K"],
                       embed="Q8_0", output="Q6_K", chat_template=False)  # fmt: skip
    with Stack(default_model_path(str(path)), env={"KV_CACHE_MB": "64"}) as running:
        yield running


def test_a_gguf_file_serves_completions_under_its_own_name(gguf_server):
    client = openai.OpenAI(base_url=gguf_server.base_url, api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny-k.Q4_K_M"]
    reply = client.completions.create(model="tiny-k.Q4_K_M", prompt="Once upon a time", max_tokens=8, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.usage.completion_tokens == 8 and len(reply.choices[0].logprobs.tokens) == 8


def test_chat_without_a_chat_template_is_a_400_that_says_so(gguf_server):
    client = openai.OpenAI(base_url=gguf_server.base_url, api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny-k.Q4_K_M", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)  # fmt: skip


def test_a_transformers_path_folder_answers_chat_with_transformers_greedy_tokens(tmp_path, model_path):
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    from launcher import Stack

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=5.0,
                          attn_logit_softcapping=8.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Name three colors of the rainbow, please."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with Stack(tmp_path, env={"KV_CACHE_MB": "64"}) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0, timeout=120)
        extra = {"ignore_eos": True, "return_token_ids": True}
        reply = client.chat.completions.create(model=running.served_model_name, messages=messages, max_tokens=10,
                                               temperature=0, extra_body=extra)  # fmt: skip
    assert reply.choices[0].token_ids == ref[0, len(ids) :].tolist()


def test_a_hybrid_folder_streams_concurrent_chats_with_transformers_greedy_tokens(tmp_path, model_path):
    """Qwen3.5's language model (gated delta net layers keeping a convolution and a recurrent
    state, between global attention layers): three chats streamed at once, each token for token
    transformers' alone; beam search, which would fork the state, a 400 that says why."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from launcher import Stack

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = AutoConfig.for_model("qwen3_5_text", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    questions = ["Name three colors of the rainbow.", "What is 12 times 12?", "Write a haiku about autumn leaves."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    refs = []
    for messages in chats:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        refs.append(out[0, len(ids) :].tolist())
    with Stack(tmp_path, env={"KV_CACHE_MB": "64"}) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0, timeout=120)
        name = running.served_model_name

        def streamed(messages) -> list[int]:
            stream = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True,
                                                                             "return_token_ids": True})  # fmt: skip
            return [t for chunk in stream for c in chunk.choices for t in c.model_extra.get("token_ids") or []]

        with ThreadPoolExecutor(len(chats)) as pool:
            got = list(pool.map(streamed, chats))
        with pytest.raises(openai.BadRequestError, match="no beam search"):
            client.completions.create(model=name, prompt="Hi", max_tokens=4, extra_body={"num_beams": 2})
    assert got == refs
