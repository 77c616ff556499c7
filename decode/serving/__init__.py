"""The OpenAI-compatible server behind ``decode/serve.py``, one module per job.

- ``config``: the typed ``ServeConfig`` and its command line (``--config`` YAML, then flags);
- ``protocol``: request bodies as strict pydantic models, OpenAI's error schema;
- ``text``: generated token ids -> text deltas, ``stop`` strings, EOS;
- ``scheduler``: the bounded queue and the one worker thread that batches requests
  continuously (``DecodeSession`` lanes: requests join and retire between rounds);
- ``metrics``: counters and their Prometheus text exposition;
- ``responses``: OpenAI's response and chunk objects, server-sent-event framing;
- ``app``: the FastAPI routes (completions, chat, models, health, metrics);
- ``connection``: uvicorn's h11 protocol with deadlines on idle connections and on headers;
- ``loading``: target, tokenizer and drafter from folders (safetensors only).

Nothing here is imported by ``decode`` itself: inference never needs the web stack.
"""
