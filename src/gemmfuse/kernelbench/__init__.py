"""KernelBench Level-2 problems that gemmfuse serves, and their ModelNew classes."""
