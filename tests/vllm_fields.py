"""The field list the honoured-or-refused tests walk (offline and on the server)."""

# vLLM's SamplingParams fields (vllm/sampling_params.py, the init fields of the peers' vLLM and the older
# ones vLLM clients still send). Each is honoured by kvloom (e2e/test_api_tail_offline.py has a behaviour check
# for each one SamplingParams accepts) or refused: a ValueError offline, a 400 on the server.
VLLM_SAMPLING_FIELDS = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "bad_words", "ignore_eos", "max_tokens",
    "min_tokens", "logprobs", "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start",
    "logprob_token_ids", "flat_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "output_kind", "stream_interval", "skip_clone", "structured_outputs",
    "logit_bias", "allowed_token_ids", "extra_args", "skip_reading_prefix_cache", "thinking_token_budget",
    "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids", "use_beam_search",
    "length_penalty", "early_stopping", "truncate_prompt_tokens", "guided_decoding", "logits_processors",
    "output_text_buffer_length")
