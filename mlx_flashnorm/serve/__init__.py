"""The serving engine behind the `server` command, one job a module.

HTTP side (never imports the engine side): `http` (the transport and its limits), `openai_api`
(the request and answer forms), `structured` (response_format), `tools` (tool calls), `streaming`
(every answer's tokens read on one thread), `page` (the chat page at /, its files in page/),
`tokenizer_api` (llama-server's /tokenize, /detokenize, /apply-template).
Between them: `requests` (Generation, Token, Ticket: what crosses the engine's edges).
Engine side: `serial` (one request at a time), `batch_worker` (the batch engine on a thread of its
own), `engine_process` (that worker in a child process), `lockstep_worker` (that worker on every
rank of mlx.launch, in lockstep), `engine` (BatchEngine: admission, prefill, slots taken and
released), `sequence` (one request in the batch, its sampling), `runner` (one batched decode step
on the device), `slots` (the batch's static KV cache and compiled step), `prompt_cache` (earlier
prompts' KV states)."""
