"""Training data from the target itself: ``eagle3fn synthesize``.

A draft accepts most when trained on its target's own answers to prompts like the ones
it will serve. With no prompts at all, the target writes them (Magpie: its chat
template's text up to a user turn, continued to the end-of-turn token); with prompts
(``--prompts``) only the answers are rewritten. The stages, in order::

    template.user_turn_prefix / answer_prompt   the text each request continues (pure)
    backends.Request -> backend -> Completion   EngineBackend (local, batched static cache),
                                                server.ServerBackend (OpenAI-compatible HTTP),
                                                GenerateBackend (transformers; the oracle)
    filters                                     empty / cut / not-a-request / duplicate prompts,
                                                empty / cut answers
    pipeline.Synthesizer                        chunks of conversations, turn by turn, written
                                                in index order; resumable
    store                                       out.jsonl + .meta.json + .rejected.jsonl
    report                                      the counts, written as out.jsonl.report.json
    run.synthesize                              all of it, as the CLI runs it
"""

from eagle3fn.synth.backends import Completion, EngineBackend, GenerateBackend, Request
from eagle3fn.synth.config import SynthConfig
from eagle3fn.synth.filters import PromptFilter, is_request
from eagle3fn.synth.pipeline import GivenPrompt, Synthesizer
from eagle3fn.synth.run import synthesize

__all__ = ["Completion", "EngineBackend", "GenerateBackend", "GivenPrompt", "PromptFilter", "Request",
           "SynthConfig", "Synthesizer", "is_request", "synthesize"]
