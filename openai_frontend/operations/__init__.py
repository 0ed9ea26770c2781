"""Operations: API keys and tenants, limits and admission, the gate in front of /v1/,
Prometheus metrics, the --dump records."""
