"""Expert quantizers: RTN, GPTQ and HAQ, all writing the packed QArray format."""
