"""The optimized (torch) backend; see its modules for the data layout."""
