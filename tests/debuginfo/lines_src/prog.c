/* A fixture for the line tables: inlined chains two deep, code in
 * .text.unlikely and in an .init.text-like section, and a header reached
 * through "sub/../" so that file names need normalizing. */
#include <stdlib.h>
#include "./sub/../helpers.h"

__attribute__((noinline, section(".text.unlikely")))
int cold_path(int x)
{
	int v = mid(x);

	return v - 1;
}

__attribute__((noinline, section(".init.text")))
int setup_once(int x)
{
	int a = mid(x * 2);

	a += cold_path(x);
	return a;
}

__attribute__((noinline))
int hot(int x)
{
	int s = 0;

	for (int i = 0; i < x; i++)
		s += mid(i);
	return s;
}

int main(int argc, char **argv)
{
	int v = argc > 1 ? atoi(argv[1]) : 3;

	return hot(v) + setup_once(v) + cold_path(v);
}
