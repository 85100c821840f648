# Convenience wrapper: `make demo`, `make test` and `make` call ./build.sh (the README's quick start).
.PHONY: all demo test clean
all:
	@./build.sh build
demo:
	@./build.sh demo
test:
	@./build.sh test
clean:
	rm -rf build
