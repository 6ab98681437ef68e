/* An assembly function: line rows from the assembler, no DWARF subprogram. */
	.text
	.globl	asm_add
	.type	asm_add, @function
asm_add:
	movl	%edi, %eax
	addl	%esi, %eax
	ret
	.size	asm_add, .-asm_add
	.section .note.GNU-stack,"",@progbits
