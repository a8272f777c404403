"""`python -m paratrain …` is `paratrain …`."""

from paratrain.cli.main import main

if __name__ == "__main__":
    main()
