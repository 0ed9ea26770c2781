"""The engine: requests in, a step at a time, outputs out.

`step()` reads as the design does: the scheduler plans the step, the model runner
computes it, the scheduler updates the sequences from what it computed and returns
the outputs. Not thread-safe by design: one thread (backend.serving.engine_thread)
owns it; `prepare` alone may run on others.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from backend.beams.group import BeamGroup
from backend.contract import ContractError, GenerationRequest, ModelInfo, RequestOutput
from backend.core.scheduler import Scheduler
from backend.core.translation import Translation
from backend.guards.policy import Guards
from backend.guards.thinking import Markers
from backend.guards.tools import ToolGuards
from backend.kv.block_manager import BlockManager
from backend.lora.peft_format import LoraWeights
from backend.lora.registry import AdapterRegistry, AdapterVersion
from backend.runner.gguf_model import model_folder
from backend.runner.model_runner import ModelRunner
from backend.sampling.grammar import CompiledGrammar
from backend.sampling.grammar_compiler import GrammarCompiler, GrammarLimits
from backend.sampling.vocab import Vocabulary, load_tokenizer
from backend.settings.engine import EngineConfig
from backend.settings.model_settings import ModelSettings
from backend.speculation.speculator import SpecStats, Speculator
from backend.types.sequence import Sequence
from backend.vision.encoder_cache import EncoderCache
from backend.vision.state import VisionState


def needs_preparing(request: GenerationRequest) -> bool:
    """Whether `prepare` has work to do for the request: a grammar to compile, an adapter to resolve."""
    return bool(request.grammar_kind or request.adapter_slot)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `prepare` made of a request, on its own thread: its grammar, and the adapter
    version its adapter_slot resolved to (pinned for its life) with that version's weights."""

    grammar: CompiledGrammar | None = None
    adapter: AdapterVersion | None = None
    adapter_weights: LoraWeights | None = None


def _without_state_steps(config: EngineConfig, architecture: str) -> None:
    """A model whose layers keep state besides attention's KV holds one state a sequence, at its
    last token: no prefix cache (a hit would skip the state's tokens), no speculative steps (a
    rejected draft would have moved it), no beams (rows forking it)."""
    if config.speculative not in ("auto", "off"):
        raise ValueError(f"SPECULATIVE={config.speculative}: {architecture}'s layers keep state besides "
                         f"attention's KV, which speculative steps would move past rejected drafts")  # fmt: skip
    if config.enable_prefix_caching or config.speculative != "off":
        print(f"{architecture}: layers keeping state besides attention's KV: prefix cache and speculative "
              f"decoding off, no beam search", file=sys.stderr)  # fmt: skip
    config.enable_prefix_caching, config.speculative = False, "off"


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        config.model_path = str(model_folder(config.model_path))  # a GGUF file: its prepared folder
        self.config = config
        self.runner = runner or ModelRunner(config)
        mc = self.runner.model_config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = tuple(mc.eos_token_ids)
        if self.runner.keeps_state:
            _without_state_steps(config, mc.architecture)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        # the context a request may use: the model's, MAX_MODEL_LEN's, and what the pool holds
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings,
            mc.max_position_embeddings,
            self.runner.num_blocks * config.block_size,
        )
        self.tokenizer = load_tokenizer(config.model_path)
        self.vocab = Vocabulary(self.tokenizer, self.vocab_size) if self.tokenizer is not None else None
        self.settings = ModelSettings.load(config.model_path)
        markers = Markers.for_model(self.settings.reasoning, self.tokenizer)
        tools = ToolGuards.for_model(self.settings.tools.call_tags, self.tokenizer)
        self.guards = Guards(self.eos_token_ids, self.max_model_len, self.settings, markers, tools)
        self.speculator = Speculator(config.speculative, config.spec_tokens, self.max_model_len, self.runner)
        self.translation = Translation.for_model(mc, self.tokenizer, self.settings)  # None: decoder-only
        # None: MAX_LORAS=0 (no adapters), a translation model or one on the generic path (adapters
        # are for decoder-only models on our own forward)
        self.adapters = (
            AdapterRegistry.for_engine(config, mc) if self.translation is None and self.runner.native else None
        )
        if not self.runner.native and (config.lora_modules or config.active_lora):
            raise ValueError(f"LORA_MODULES / ACTIVE_LORA: adapters are served on our own forward; "
                             f"{mc.architecture} runs on the transformers path")  # fmt: skip
        self.vision = getattr(mc, "vision", None) if self.translation is None else None  # None: text only
        encoder_cache = EncoderCache(config.encoder_cache_tokens) if self.vision is not None else None
        if encoder_cache is not None:
            self.runner.encoder_cache = encoder_cache  # the runner fills it, the scheduler's budget reads it
        self.scheduler = Scheduler(
            self.block_manager,
            self.guards,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.speculator,
            self.runner.lora,
            config.scheduling_policy,
            encoder_cache=encoder_cache,
            vision_merge=self.vision.merge_size if self.vision is not None else 0,
            whole_prompts=self.runner.whole_prompts,
        )
        self._lora_counts: dict[str, tuple[int, int]] = {}  # lora_requests' names so far
        self._grammars: GrammarCompiler | None = None  # made on the first grammar request
        self._grammars_lock = threading.Lock()

    def model_info(self) -> ModelInfo:
        """The facts the frontend reads from the running model."""
        reasoning, tools = self.settings.reasoning, self.settings.tools
        start, end = tools.call_tags
        return ModelInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            sampling_defaults=dict(self.settings.sampling),
            think_start=reasoning.think_start,
            think_end=reasoning.think_end,
            tool_parser=tools.parser,
            tool_call_start=start,
            tool_call_end=end,
            max_beams=self.max_beams,
            beam_defaults=self.settings.beams.defaults(),
            vision=self.vision,
            **(self.translation.model_info() if self.translation is not None else {}),
        )

    @property
    def max_beams(self) -> int:
        """num_beams a request may ask for: MAX_BEAMS, and the rows one step may hold."""
        return min(self.config.max_beams, self.config.max_num_seqs) if not self.runner.keeps_state else 1

    # -- requests -----------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> Prepared:
        """What a request needs before `add_request` that may run on any thread: its
        grammar, compiled (or taken from its tenant's cache), and its adapter, resolved and
        its weights at hand. The Triton model calls it on a thread of the request's own
        (backend.serving.preparer), so a slow compilation or an adapter read from disk
        stalls neither the running batch nor other requests. Raises ContractError naming
        grammar_kind / grammar_spec / adapter_slot."""
        grammar = None
        if request.grammar_kind:
            compiler = self.grammar_compiler()
            grammar = compiler.compile(request.grammar_kind, request.grammar_spec, request.lookup_tenant)
        if not request.adapter_slot:
            return Prepared(grammar)
        if self.adapters is None:
            raise ContractError("adapter_slot", "this server serves no LoRA adapters (MAX_LORAS=0)")
        adapter = self.adapters.resolve(request.adapter_slot)
        weights = self.adapters.weights(adapter) if adapter is not None else None
        return Prepared(grammar, adapter, weights)

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (its worker processes, its cache of compiled
        grammars); thread-safe."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ContractError("grammar_kind", "this model folder has no tokenizer, which grammars need")
                config = self.config
                limits = GrammarLimits(
                    compile_timeout_s=config.grammar_compile_timeout_s,
                    workers=config.grammar_compile_workers,
                    per_tenant=config.grammar_compiles_per_tenant,
                    max_spec_nodes=config.grammar_max_spec_nodes,
                    max_spec_chars=config.grammar_max_spec_chars,
                )
                self._grammars = GrammarCompiler(config.model_path, self.vocab_size, self.eos_token_ids, limits=limits)
            return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler's worker processes (the engine thread's last act)."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()

    def add_request(
        self,
        request_id: str,
        request: GenerationRequest,
        arrival_time: float | None = None,
        prepared: Prepared | None = None,
    ) -> None:
        """Queue a validated request (`GenerationRequest.validate`, with this model's
        vocabulary and context); `prepared`: what `prepare` made of it, else it is prepared
        here. Raises ContractError naming the field for what only the engine can judge."""
        if prepared is None:
            prepared = self.prepare(request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        encoder = self.translation.encoder_state(request) if self.translation is not None else None
        if encoder is None and (request.src_lang_id or request.tgt_lang_id):
            field = "src_lang_id" if request.src_lang_id else "tgt_lang_id"
            raise ContractError(field, "this model does not translate")
        if request.priority and self.config.scheduling_policy != "priority":
            raise ContractError("priority", "this server schedules first come, first served (SCHEDULING_POLICY=fcfs)")
        vision = self._vision_state(request)
        guard_state = self.guards.admit(request, arrival, prepared.grammar)
        seq = Sequence.of(request_id, request, arrival, guard_state, encoder)
        seq.vision = vision
        seq.adapter, seq.adapter_weights = prepared.adapter, prepared.adapter_weights
        params = request.sampling
        if params.dry_multiplier and self.vocab is not None:
            seq.dry_breaker_ids = self.vocab.ids_containing(params.dry_sequence_breakers)
        if request.num_beams > 1:
            if request.num_beams > self.max_beams:
                stateful = self.runner.keeps_state
                why = ("no beam search: this model's layers keep state besides attention's KV" if stateful
                       else f"must be at most {self.max_beams} on this server (MAX_BEAMS)")  # fmt: skip
                raise ContractError("num_beams", why)
            BeamGroup.start(seq, self.guards.stop_ids(params), self.eos_token_ids, self.max_model_len)
        elif encoder is None and vision is None:  # drafters see no pictures: a vision request never drafts
            seq.spec = self.speculator.admit(request)
        self.scheduler.add(seq)

    def _vision_state(self, request: GenerationRequest) -> VisionState | None:
        """A vision request's state (None: none); ContractError for images sent to a text
        model, or placeholder tokens that do not match the images sent."""
        if self.vision is None:
            if request.vision:
                raise ContractError("vision_kinds", "this model takes no images or videos (it is a text-only model)")
            return None
        placeholders = {self.vision.image_token_id, self.vision.video_token_id}
        if not request.vision and placeholders.isdisjoint(request.prompt_tokens):
            return None
        return VisionState.of(request.prompt_tokens, request.vision, self.vision)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its final output (abort) comes out of the next step()."""
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self) -> list[str]:
        """Every request whose final output has not come out of a step yet."""
        return self.scheduler.request_ids()

    # -- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()  # drafting included: its cost is the step's
        if plan.is_empty:
            return self.scheduler.update(plan, None)
        starts = [item.seq.num_computed_tokens for item in plan.scheduled]
        result = self.runner.execute(plan.scheduled)
        outputs = self.scheduler.update(plan, result)
        self.runner.copy_blocks(self.scheduler.take_block_copies())  # forked beams' KV, before the next forward
        self.speculator.keep_hidden(plan.scheduled, starts, result.hidden_states, result.query_start)
        self.speculator.observe(plan.num_tokens, time.perf_counter() - start)  # the cost model's evidence
        return outputs

    # -- state, for the Triton model's gauges ----------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counters since start (a copy)."""
        return self.speculator.stats.copy()

    def take_kv_events(self) -> list:
        """The prefix cache's KV events since the last call (backend.serving.kv_events)."""
        return self.block_manager.take_events()

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def num_running(self) -> int:
        """Sequences admitted to the batch (vLLM's num_requests_running)."""
        return len(self.scheduler.running)

    @property
    def max_loras(self) -> int:
        """Adapters one step may use; 0 when the server serves none."""
        return self.config.max_loras if self.adapters is not None else 0

    def lora_requests(self) -> dict[str, tuple[int, int]]:
        """(running, waiting) sequences per adapter name, for every name seen since start
        (vLLM's lora_requests_info reads the names with a count above 0)."""
        if self.adapters is None:
            return {}
        counts = self._lora_counts
        for name in counts:
            counts[name] = (0, 0)
        for queue, place in ((self.scheduler.running, 0), (self.scheduler.waiting, 1)):
            for seq in queue:
                if seq.adapter is not None:
                    running, waiting = counts.get(seq.adapter.name, (0, 0))
                    counts[seq.adapter.name] = (running + (place == 0), waiting + (place == 1))
        return dict(counts)

    def num_waiting(self) -> int:
        """Sequences queued for admission, preempted ones included (num_requests_waiting)."""
        return len(self.scheduler.waiting)

    # -- convenience for tests and benchmarks ------------------------------

    def generate(self, prompts: list[list[int]], params) -> list[list[int]]:
        """Run prompts to completion together under SamplingParams (one, or one each);
        return each one's emitted tokens."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, GenerationRequest(list(prompt), p))
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.scheduler.requests for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.token_ids)
        return [results[rid] for rid in ids]
