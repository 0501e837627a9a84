package org.splitface.core;

/**
 * An exported program's forward method: float tensors in, float tensors out, each a flat C-order array of the
 * program's own input shape. {@link NativeProgram} runs it through ExecuTorch's C++ runtime (JNI); the Android
 * app can equally wrap ExecuTorch's {@code org.pytorch.executorch.Module}.
 */
public interface Program extends AutoCloseable {
    /** The shape of input {@code index}, as the program was exported. */
    long[] inputShape(int index);

    /** Runs the program; one array per input, one per output. */
    float[][] forward(float[][] inputs);

    @Override void close();
}
