"""Soft prompts for keras-hub backbones (Wu et al., EMNLP 2022: hybrid prompt tuning):
shallow and deep prompts for T5Backbone, shallow prompts for BertBackbone-family encoders,
shallow prompts and deep prefixes for decoder LMs (GPT-2, Gemma, Llama: `prompt_causal_lm`,
generation through keras-hub's `CausalLM.generate`; loaded on first use), T5 scoring
and greedy generation, prompt-only files; prompt templates, rank classification, the
few-shot prompt-tuning protocol and Average Relative Gain; Hugging Face PEFT prompt-tuning /
prefix-tuning adapters in and out (`load_peft_adapter`, `save_peft_adapter`)."""

from tf_metaalign.prompts import (  # noqa: F401
    base,
    bert,
    evaluation,
    peft_adapters,
    storage,
    t5,
    t5_lm,
    templates,
)
from tf_metaalign.prompts.base import TrainableSelection
from tf_metaalign.prompts.bert import PromptedBert, prompt_bert
from tf_metaalign.prompts.evaluation import (
    BootstrapResult,
    FewShotResult,
    accuracy,
    average_relative_gain,
    choice_scores,
    few_shot_prompt_tuning,
    paired_bootstrap_arg,
    rank_classification,
    rank_classify_examples,
    relative_gain,
    sample_few_shot,
    stable_seed,
    token_log_likelihoods,
)
from tf_metaalign.prompts.peft_adapters import load_peft_adapter, save_peft_adapter
from tf_metaalign.prompts.storage import load_prompt, save_prompt
from tf_metaalign.prompts.t5 import (
    PromptedT5,
    prompt_t5,
    shift_right,
    t5_generate,
    t5_token_log_likelihoods,
)
from tf_metaalign.prompts.t5_lm import PromptedT5LM, encode_examples, masked_token_loss
from tf_metaalign.prompts.templates import PromptedExample, Template, apply_templates

# Decoder LMs (prompts.causal_lm) import keras-hub: loaded on first use of one of these.
_CAUSAL_LM_NAMES = (
    "causal_lm",
    "PromptedCausalLM",
    "prompt_causal_lm",
    "causal_lm_token_log_likelihoods",
    "causal_lm_score_fn",
)


def __getattr__(name):
    if name in _CAUSAL_LM_NAMES:
        import importlib

        module = importlib.import_module("tf_metaalign.prompts.causal_lm")
        return module if name == "causal_lm" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "bert",
    "evaluation",
    "peft_adapters",
    "storage",
    "t5",
    "t5_lm",
    "templates",
    "PromptedT5LM",
    "encode_examples",
    "masked_token_loss",
    "stable_seed",
    "BootstrapResult",
    "FewShotResult",
    "PromptedExample",
    "Template",
    "accuracy",
    "apply_templates",
    "average_relative_gain",
    "choice_scores",
    "few_shot_prompt_tuning",
    "paired_bootstrap_arg",
    "rank_classification",
    "rank_classify_examples",
    "relative_gain",
    "sample_few_shot",
    "token_log_likelihoods",
    "TrainableSelection",
    "PromptedBert",
    "prompt_bert",
    "load_prompt",
    "save_prompt",
    "load_peft_adapter",
    "save_peft_adapter",
    "PromptedT5",
    "prompt_t5",
    "shift_right",
    "t5_generate",
    "t5_token_log_likelihoods",
    "causal_lm",
    "PromptedCausalLM",
    "prompt_causal_lm",
    "causal_lm_token_log_likelihoods",
    "causal_lm_score_fn",
]
