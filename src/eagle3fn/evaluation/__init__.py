"""Measuring a draft where users decide: chain speculative decoding with a HF target and
an EAGLE-3 draft, its acceptance, its speedup over the target alone, and the output check.

Legend: V target vocab, Vd draft vocab, k draft tokens per round, B prompts of a batch.

The modules, from the rules up to the report::

    config        SpecConfig, the implementations, input checks (prompts, EOS ids, d2t)
    results       SpecResult per prompt, acceptance_stats, a round appended to the tokens
    verify        sampling and verification rules (greedy, speculative sampling), choosers
    chain         the draft's chain of one row without a cache (propose)
    twin          speculative_generate: one prompt, no cache, the readable twin
    kv            the target's cached forward; crop, compaction of both caches
    cached_draft  the draft on its own KV cache: context rows, the batched chain
    static_draft  the same on fixed-shape buffers (CUDA-graph replays)
    timing        StageTimes: where generate's time goes
    rounds        what the batched paths share: setup, live rows, one round's verify
    dynamic       generate(impl="dynamic"): caches grown per round
    static        generate(impl="static"): the draft on static buffers
    graphed       generate(impl="graph"): the target on a static cache too, CUDA graphs
    generation    generate (dispatch over the three) and default_impl
    baseline      target_generate: the target alone, the speedup's denominator
    identity      greedy output against the target alone (near-ties reported, bugs raised)
    report        evaluate (timed beside the baseline) and simulated_tau
    sweep         every k and batch size, the best k per batch

A module reads only modules above it in this list (``baseline`` reads ``graphed``).
"""

from eagle3fn.evaluation.baseline import target_generate
from eagle3fn.evaluation.chain import Proposal, propose
from eagle3fn.evaluation.config import GRAPH, IMPLS, SpecConfig
from eagle3fn.evaluation.generation import default_impl, generate
from eagle3fn.evaluation.identity import Divergence, IdentityReport, OutputMismatch, check_identity
from eagle3fn.evaluation.report import evaluate, simulated_tau
from eagle3fn.evaluation.results import SpecResult, acceptance_stats
from eagle3fn.evaluation.sweep import implied_acceptance_length, sweep
from eagle3fn.evaluation.timing import StageTimes
from eagle3fn.evaluation.twin import speculative_generate
from eagle3fn.evaluation.verify import residual_distribution, sample_from, verify_greedy, verify_sampled

__all__ = ["Divergence", "GRAPH", "IMPLS", "IdentityReport", "OutputMismatch", "Proposal", "SpecConfig",
           "SpecResult", "StageTimes", "acceptance_stats", "check_identity", "default_impl", "evaluate",
           "generate", "implied_acceptance_length", "propose", "residual_distribution", "sample_from",
           "simulated_tau", "speculative_generate", "sweep", "target_generate", "verify_greedy",
           "verify_sampled"]
