"""The parts of scripts/make_fixtures.py, one module per job.

    specs           the fixture list: each fixture's model config, tokenizer style and on-disk layout
    tokenizer       the shared byte-level BPE and each family's tokenizer files
    chat_templates  the families' published chat templates, verbatim
    config          config.json (hub or transformers 5 conventions) and generation_config.json
    weights         seeded weights, their hub tensor names and the sharded safetensors files
    quantize        the FP8 (block and per-channel) and MXFP4 quantizers and FP8 quantization_config entries
    reference       the float32 transformers reference (seed choice, greedy runs) and its reload checks
    files           JSON as the hub writes it, tensor names in natural order

scripts/make_fixtures.py drives them; its docstring describes the fixtures.
"""
