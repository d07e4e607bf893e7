"""Structured output (OpenAI's `response_format`): the API turns it into a grammar or a 400; the engine
masks every constrained row so the answer is valid JSON for the schema, stopping when it is complete.

The reference is transformers' greedy `generate` on the same tiny model, constrained by an independent
llguidance matcher through a logits processor: the engine's constrained tokens must equal it."""

import json
import re

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from app.api.schemas import parse_chat_request
from app.errors import ClientError
from app.llm.engine import Engine
from app.llm.grammar import grammar_for
from helpers import _pixels, make_request, reference_logits

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "color": {"enum": ["red", "green", "blue"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


NESTED = _nested(450)  # 900 levels: a JSON body parses, Python's encoder and llguidance's parser refuse it


def valid(obj) -> bool:
    return (set(obj) == {"ok", "n", "color"} and isinstance(obj["ok"], bool) and type(obj["n"]) is int
            and 0 <= obj["n"] <= 9 and obj["color"] in ("red", "green", "blue"))


def parse(extra):
    return parse_chat_request({"messages": [{"role": "user", "content": "x"}]} | extra, 16, 4)


def test_the_api_turns_response_format_into_a_grammar_or_none():
    assert parse({}).params.grammar is None and parse({"response_format": {"type": "text"}}).params.grammar is None
    assert parse({"response_format": FORMAT}).params.grammar == grammar_for(FORMAT)
    assert parse({"response_format": {"type": "json_object"}}).params.grammar
    assert parse({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}).params.grammar
    from app.llm.grammar import _schema_grammar

    hits = _schema_grammar.cache_info().hits
    again = {"type": "json_schema", "json_schema": {"schema": json.loads(json.dumps(SCHEMA)), "name": "b"}}
    assert parse({"response_format": again}).params.grammar == grammar_for(FORMAT)
    assert _schema_grammar.cache_info().hits == hits + 2  # the same schema compiled once


def test_properties_come_in_the_schemas_order_not_sorted(world):
    """Clients order properties on purpose ("reasoning" before "answer"); the schema used to be compiled
    from its key-sorted text, which made the answer's properties come alphabetically."""
    import llguidance
    import llguidance.hf

    tok = world["tok"]
    schema = {"type": "object", "additionalProperties": False, "required": ["reasoning", "answer"],
              "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}}
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})

    def accepts(text):
        m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)), grammar, log_level=0)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts('{"reasoning":"x","answer":1}') and not accepts('{"answer":1,"reasoning":"x"}')


@pytest.mark.parametrize("fmt,says", [
    ({"type": "xml"}, "'response_format.type' must be"),
    ("json", "must be an object"),
    ({"type": "json_schema", "json_schema": []}, "json_schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": 1}}, "json_schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": NESTED}}, "invalid JSON schema"),
])
def test_a_bad_response_format_is_a_400_naming_it(fmt, says):
    with pytest.raises(ClientError, match=says) as e:
        parse({"response_format": fmt})
    assert (e.value.status, e.value.param, e.value.code) == (400, "response_format", "invalid_response_format")


class _Constrained(LogitsProcessor):
    """transformers' side of the reference: an llguidance matcher of its own masks each step's scores."""

    def __init__(self, grammar: str, tokenizer, vocab: int, prompt_len: int):
        import llguidance
        import llguidance.hf

        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar)
        self.prompt_len, self.vocab = prompt_len, vocab

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        if self.matcher.is_stopped():  # complete: the reference ends where the engine stops
            allowed = torch.zeros(self.vocab, dtype=torch.bool)
            allowed[self.matcher_eos] = True
        else:
            bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
            allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[:self.vocab].bool()
        return scores.masked_fill(~allowed[None, :scores.shape[1]], float("-inf"))


@pytest.mark.parametrize("kinds", [[], ["image"]])
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_constrained_tokens_equal_transformers_constrained_by_the_same_grammar(world, tiny_checkpoint, kinds,
                                                                                     overlap):
    grammar = grammar_for(FORMAT)
    req, items, prompt = make_request(world, kinds, data_seed=3, words=4, max_tokens=60, grammar=grammar)
    eng = Engine(str(tiny_checkpoint), overlap_steps=overlap)
    chunks = list(eng.generate(req))
    tokens = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and valid(json.loads(text))
    vocab = eng.spec.vocab
    proc = _Constrained(grammar, world["tok"], vocab, len(prompt.input_ids))
    proc.matcher_eos = world["tok"].eos_token_id
    ids = torch.tensor([prompt.input_ids])
    ref = world["ref"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids]), max_new_tokens=60,
                                do_sample=False, logits_processor=LogitsProcessorList([proc]),
                                **_pixels(prompt, items))[0, ids.shape[1]:].tolist()
    assert ref[:len(tokens)] == tokens and ref[len(tokens):] == [world["tok"].eos_token_id]
    assert eng.grammars.live == 0
    eng.shutdown()


def test_sampled_choices_each_follow_the_schema_beside_free_text(world, tiny_checkpoint):
    """Temperature 1, four choices with a schema queued with a free-text request (overlapped steps
    pause while the constrained ones run): every choice is valid JSON for the schema and stops when
    complete; the choices differ; the free-text request is what it is alone."""
    eng = Engine(str(tiny_checkpoint), overlap_steps=True)
    req = make_request(world, ["image"], data_seed=4, temperature=1.0, seed=11, n=4, max_tokens=60,
                       grammar=grammar_for(FORMAT))[0]
    free = make_request(world, [], data_seed=5, words=3, max_tokens=12)[0]
    free_seq = eng.submit(free)
    chunks = list(eng.generate(req))
    texts = ["".join(c.text for c in chunks if c.index == i) for i in range(4)]
    answers = [json.loads(t) for t in texts]
    assert all(valid(a) for a in answers) and len({json.dumps(a) for a in answers}) > 1
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"] * 4
    got = []
    while not got or not got[-1].finish_reason:
        got.append(free_seq.next_chunk(timeout=60))
    alone = [t for c in world["engine"].generate(free) for t in c.token_ids]
    assert [t for c in got for t in c.token_ids] == alone
    assert eng.grammars.live == 0
    eng.shutdown()


def test_json_object_gives_an_object(world, tiny_checkpoint):
    req = make_request(world, [], data_seed=6, max_tokens=200, grammar=grammar_for({"type": "json_object"}))[0]
    chunks = list(world["engine"].generate(req))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(text), dict)


def test_log_probabilities_under_a_format_are_the_models_own(world, tiny_checkpoint):
    """With a format and `top_logprobs`, each token's entries are transformers' raw log-softmax at its
    position (teacher-forced on the constrained answer), not renormalised over the allowed tokens: no
    -inf for the tokens the schema forbids."""
    req, items, prompt = make_request(world, ["image"], data_seed=7, max_tokens=60, logprobs=3,
                                      grammar=grammar_for(FORMAT))
    chunks = list(world["engine"].generate(req))
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs or []]
    assert len(entries) == len(tokens) and valid(json.loads("".join(c.text for c in chunks)))
    want = torch.log_softmax(reference_logits(world, prompt, items, tokens).float(), -1)
    worst = 0.0
    for i, (lp, top_ids, top) in enumerate(entries):
        assert list(top_ids) == want[i].topk(3).indices.tolist()
        worst = max(worst, abs(lp - float(want[i, tokens[i]])),
                    *(abs(a - float(b)) for a, b in zip(top, want[i].topk(3).values)))
    assert worst <= 1e-4, worst


@pytest.mark.gpu
def test_constrained_answers_on_gpu_from_graphs_with_overlap_equal_the_cpu_engines(world, tiny_checkpoint):
    """On CUDA in fp32 (decode graphs, step graphs, overlapped steps paused for the grammar): greedy
    constrained answers with an image equal the CPU engine's, and sampled choices follow the schema."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(str(tiny_checkpoint), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                 num_kv_blocks=512)
    assert eng.overlap and eng.runner.graphs
    grammar = grammar_for(FORMAT)
    for seed in range(3):
        req = make_request(world, ["image"], data_seed=seed, words=seed, max_tokens=60, grammar=grammar)[0]
        cpu = [t for c in world["engine"].generate(req) for t in c.token_ids]
        for v in req.vision:
            v.main, v.deepstack = v.main.cuda(), [d.cuda() for d in v.deepstack]
        assert [t for c in eng.generate(req) for t in c.token_ids] == cpu
    req = make_request(world, [], data_seed=9, temperature=1.0, seed=3, n=4, max_tokens=60, grammar=grammar)[0]
    chunks = list(eng.generate(req))
    assert all(valid(json.loads("".join(c.text for c in chunks if c.index == i))) for i in range(4))
    assert eng.grammars.live == 0
    eng.shutdown()


def test_a_token_its_grammar_refuses_fails_that_request_alone(world, tiny_checkpoint, monkeypatch):
    """Should a sampled token ever be one the matcher refuses (masks make this a defect, not an input),
    that request ends with an error and the engine serves the others: a free-text request beside it
    gets its lone answer."""
    from app.llm.grammar import Grammars

    eng = Engine(str(tiny_checkpoint))
    real = Grammars.masked
    monkeypatch.setattr(Grammars, "masked", lambda self, logits, matchers: logits)  # no mask: refused tokens
    constrained = eng.submit(make_request(world, [], data_seed=8, max_tokens=30, grammar=grammar_for(FORMAT))[0])
    free = make_request(world, ["image"], data_seed=9, max_tokens=8)[0]
    free_seq = eng.submit(free)
    with pytest.raises(RuntimeError, match="was not allowed"):
        while not constrained.next_chunk(timeout=60).finish_reason:
            pass
    got = []
    while not got or not got[-1].finish_reason:
        got.append(free_seq.next_chunk(timeout=60))
    assert [t for c in got for t in c.token_ids] == [t for c in world["engine"].generate(free) for t in c.token_ids]
    monkeypatch.setattr(Grammars, "masked", real)
    assert eng.grammars.live == 0
    eng.shutdown()


def test_a_grammar_is_compiled_once_and_each_sequence_gets_its_own_matcher(world):
    """One schema sent with every request (a batch job's rows) is compiled once; each sequence copies
    the start state, so one sequence's tokens never move another's matcher. The cache keeps the most
    recently used grammars only."""
    from app.llm.grammar import Grammars

    g = Grammars(world["tok"], world["engine"].spec.vocab)
    g.CACHED = 2
    grammar = grammar_for(FORMAT)
    assert g.compile(grammar) is g.compile(grammar)
    a, b = g.matcher(grammar), g.matcher(grammar)
    brace = world["tok"].convert_tokens_to_ids("{")
    assert a.consume_token(brace) and not a.is_stopped()
    assert b.consume_token(brace) and g.matcher(grammar).consume_token(brace)  # b and the template unmoved by a
    others = [grammar_for({"type": "json_schema", "json_schema": {"schema": {"enum": [str(i)]}}}) for i in range(2)]
    for o in others:
        g.compile(o)
    assert list(g._compiled) == others


def test_constrained_answers_survive_preemption(world, tiny_checkpoint):
    """Eight constrained greedy requests in a pool of 40 blocks of 4 tokens: decodes preempt later
    arrivals, which recompute prompt and output; each matcher keeps its state, and every answer equals
    the one the engine gives the request alone with room to spare."""
    eng = Engine(str(tiny_checkpoint), num_kv_blocks=41, block_size=4, max_num_batched_tokens=64)
    grammar = grammar_for(FORMAT)
    reqs = [make_request(world, kinds, data_seed=30 + i, words=i, max_tokens=40, grammar=grammar)[0]
            for i, kinds in enumerate([[], ["image"], ["video"], [], ["image"], [], ["video"], ["image"]])]
    with eng._cv:
        seqs = [eng.submit(r) for r in reqs]
    got = []
    for s in seqs:
        chunks = []
        while not chunks or not chunks[-1].finish_reason:
            chunks.append(s.next_chunk(timeout=120))
        got.append("".join(c.text for c in chunks))
    assert eng.scheduler.preemptions > 0 and eng.grammars.live == 0
    alone = ["".join(c.text for c in world["engine"].generate(r)) for r in reqs]
    assert got == alone and all(valid(json.loads(t)) for t in got)
    eng.shutdown()


@pytest.mark.parametrize("spec,check", [
    ({"choice": ["cat", "dog", "bird"]}, lambda t: t in ("cat", "dog", "bird")),
    ({"choice": ["a-b #c & ~d (e) [f]*"]}, lambda t: t == "a-b #c & ~d (e) [f]*"),  # verbatim, not a pattern
    ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t) is not None),
    ({"grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'},
     lambda t: t in ("yes", "no") or re.fullmatch("maybe [0-9]", t) is not None),
    ({"json": SCHEMA}, lambda t: valid(json.loads(t))),
])
def test_vllms_structured_outputs_extension(world, spec, check):
    """vLLM's `structured_outputs` (choice, regex, grammar, json) through the API's parser and the
    engine: four sampled choices each match, and stop when complete."""
    params = parse({"structured_outputs": spec}).params
    req = make_request(world, ["image"], data_seed=12, temperature=1.0, seed=4, n=4, max_tokens=40,
                       grammar=params.grammar)[0]
    chunks = list(world["engine"].generate(req))
    texts = ["".join(c.text for c in chunks if c.index == i) for i in range(4)]
    assert all(check(t) for t in texts), texts
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"] * 4


@pytest.mark.parametrize("spec", [{"choice": []}, {"choice": ["a", 1]}, {"regex": "(("}, {"grammar": "start: ???"},
                                  {"choice": ["a"], "regex": "b"}, {"foo": 1}, "x", {"json": 1}, {"json": NESTED}])
def test_a_bad_structured_outputs_is_a_400_naming_it(spec):
    with pytest.raises(ClientError) as e:
        parse({"structured_outputs": spec})
    assert (e.value.status, e.value.param, e.value.code) == (400, "structured_outputs", "invalid_structured_outputs")
    with pytest.raises(ClientError, match="not both"):
        parse({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}})


def test_an_end_of_sequence_before_the_answer_is_complete_is_an_error_not_a_stop(world, tiny_checkpoint, monkeypatch):
    """A matcher in an error state (past llguidance's limits, say) allows only the end of sequence; the
    answer must then fail, not end with "stop" looking complete. Forced here: the mask allows only EOS."""
    from app.llm.grammar import Grammars

    eng = Engine(str(tiny_checkpoint))
    eos = world["tok"].eos_token_id

    def only_eos(self, logits, matchers):
        out = logits.clone()
        for i, m in enumerate(matchers):
            if m is not None:
                out[i] = float("-inf")
                out[i, eos] = 0.0
        return out

    monkeypatch.setattr(Grammars, "masked", only_eos)
    seq = eng.submit(make_request(world, [], data_seed=8, max_tokens=30, grammar=grammar_for(FORMAT))[0])
    with pytest.raises(RuntimeError, match="not complete"):
        while not seq.next_chunk(timeout=60).finish_reason:
            pass
    assert eng.grammars.live == 0
    eng.shutdown()
