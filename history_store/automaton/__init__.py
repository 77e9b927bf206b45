"""The suffix automaton that DAS drafts from: one arena of many trees, the per-problem index over it, and the threads that draft a batch."""
