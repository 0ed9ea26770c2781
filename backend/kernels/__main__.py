"""`python -m backend.kernels`: build the CPU kernels now (`make setup` and `launcher setup` do)."""

from backend.kernels.build import main

if __name__ == "__main__":
    main()
