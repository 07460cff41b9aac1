//! The shared, reference-counted message store (being written).
