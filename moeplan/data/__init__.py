"""Training data on disk: Megatron's indexed datasets (`indexed`), `--data` blends and splits
cut into training windows (`corpus`), Hugging Face tokenizers (`tokenizer`) and `moeplan data
prepare` (`prepare`). numpy only, never torch: the launcher checks a dataset before any worker
starts, and a corpus is prepared on machines without torch (docs/DATA.md)."""
