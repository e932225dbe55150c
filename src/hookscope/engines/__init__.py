"""Where a model runs that is not one process's eager module: a vLLM engine (its model classes'
name tables with the fused residual put back, code installed in its workers, rows per request) and
a tensor-parallel model (points sharded across ranks gathered whole). Each engine gives the verbs
the same names and meanings as a Hugging Face model, built on the core's `Selection`, `Edit`,
`Hooks` and `Capture`; the extraction loop runs them as executors."""
