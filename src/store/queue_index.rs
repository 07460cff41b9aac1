//! The per-queue index: journal and segment files (being written).
