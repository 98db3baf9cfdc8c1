"""Encoder models for embeddings, reranking and scores (BERT, nomic-bert): config, weights, tokenizer, forward
pass and the batching engine; pooling options shared with decoders served with task "embed"."""
