// libsplitface_jni: an exported program's forward method through ExecuTorch's C++ runtime, for Java
// (android_demo/core's org.splitface.core.NativeProgram). The same source is what an Android build compiles
// with the NDK against ExecuTorch's Android libraries; here it links the wheel's libraries (CMakeLists.txt),
// so that the demo's Java device runs the im2col programs (XNNPACK, weights as inputs) on the host JVM.
//
// Float32 tensors only, in and out (the device layer's programs): every input is checked against the
// program's own input shapes before anything runs, and a mismatch or a failed call throws
// IllegalArgumentException or IllegalStateException with the reason instead of crashing the JVM.
#include <jni.h>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/extension/threadpool/threadpool_guard.h>

#include <atomic>

#include <memory>
#include <string>
#include <vector>

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::from_blob;
using executorch::runtime::EValue;

namespace {

constexpr const char* kMethod = "forward";
std::atomic<bool> g_single_thread{false};  // setSingleThread: XNNPACK on the calling thread, no pool

void throw_java(JNIEnv* env, const char* cls, const std::string& why) {
  jclass c = env->FindClass(cls);
  if (c != nullptr) env->ThrowNew(c, why.c_str());
}

std::string shape_text(const std::vector<SizesType>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// A loaded program and its inputs' shapes, from its method metadata.
struct Loaded {
  std::unique_ptr<Module> module;
  std::vector<std::vector<SizesType>> shapes;
};

Loaded* handle_of(JNIEnv* env, jlong handle) {
  if (handle == 0) throw_java(env, "java/lang/IllegalStateException", "the program is closed");
  return reinterpret_cast<Loaded*>(handle);
}

}  // namespace

extern "C" JNIEXPORT jlong JNICALL Java_org_splitface_core_NativeProgram_load(JNIEnv* env, jclass, jstring path) {
  const char* chars = env->GetStringUTFChars(path, nullptr);
  std::string file(chars);
  env->ReleaseStringUTFChars(path, chars);
  auto loaded = std::make_unique<Loaded>();
  loaded->module = std::make_unique<Module>(file, Module::LoadMode::Mmap);
  if (loaded->module->load_method(kMethod) != executorch::runtime::Error::Ok) {
    throw_java(env, "java/lang/IllegalArgumentException", "cannot load the forward method of " + file);
    return 0;
  }
  auto meta = loaded->module->method_meta(kMethod);
  if (!meta.ok()) {
    throw_java(env, "java/lang/IllegalArgumentException", "no forward method metadata in " + file);
    return 0;
  }
  for (size_t i = 0; i < meta->num_inputs(); ++i) {
    auto in = meta->input_tensor_meta(i);
    if (!in.ok() || in->scalar_type() != ScalarType::Float) {
      throw_java(env, "java/lang/IllegalArgumentException", file + ": input " + std::to_string(i) + " is not a float tensor");
      return 0;
    }
    loaded->shapes.emplace_back(in->sizes().begin(), in->sizes().end());
  }
  return reinterpret_cast<jlong>(loaded.release());
}

extern "C" JNIEXPORT jint JNICALL Java_org_splitface_core_NativeProgram_inputCount(JNIEnv* env, jclass, jlong handle) {
  Loaded* p = handle_of(env, handle);
  return p == nullptr ? 0 : static_cast<jint>(p->shapes.size());
}

extern "C" JNIEXPORT jlongArray JNICALL Java_org_splitface_core_NativeProgram_inputShape(JNIEnv* env, jclass, jlong handle,
                                                                                       jint index) {
  Loaded* p = handle_of(env, handle);
  if (p == nullptr) return nullptr;
  if (index < 0 || static_cast<size_t>(index) >= p->shapes.size()) {
    throw_java(env, "java/lang/IndexOutOfBoundsException", "input " + std::to_string(index));
    return nullptr;
  }
  const auto& shape = p->shapes[index];
  std::vector<jlong> dims(shape.begin(), shape.end());
  jlongArray out = env->NewLongArray(static_cast<jsize>(dims.size()));
  env->SetLongArrayRegion(out, 0, static_cast<jsize>(dims.size()), dims.data());
  return out;
}

// inputs: one float[] per program input, each holding exactly its shape's elements (C order). Returns one
// float[] per output.
extern "C" JNIEXPORT jobjectArray JNICALL Java_org_splitface_core_NativeProgram_forward(JNIEnv* env, jclass, jlong handle,
                                                                                       jobjectArray inputs) {
  Loaded* p = handle_of(env, handle);
  if (p == nullptr) return nullptr;
  jsize count = inputs == nullptr ? 0 : env->GetArrayLength(inputs);
  if (static_cast<size_t>(count) != p->shapes.size()) {
    throw_java(env, "java/lang/IllegalArgumentException", "the program takes " + std::to_string(p->shapes.size()) +
               " inputs, got " + std::to_string(count));
    return nullptr;
  }
  std::vector<std::vector<float>> buffers(count);
  std::vector<TensorPtr> tensors;  // alive until the call returns: an EValue only refers to its tensor
  std::vector<EValue> args;
  for (jsize i = 0; i < count; ++i) {
    auto array = static_cast<jfloatArray>(env->GetObjectArrayElement(inputs, i));
    size_t numel = 1;
    for (SizesType d : p->shapes[i]) numel *= static_cast<size_t>(d);
    jsize length = array == nullptr ? -1 : env->GetArrayLength(array);
    if (length < 0 || static_cast<size_t>(length) != numel) {
      throw_java(env, "java/lang/IllegalArgumentException", "input " + std::to_string(i) + " has " +
                 std::to_string(length) + " values; its shape " + shape_text(p->shapes[i]) + " takes " + std::to_string(numel));
      return nullptr;
    }
    buffers[i].resize(numel);
    env->GetFloatArrayRegion(array, 0, length, buffers[i].data());
    env->DeleteLocalRef(array);
    tensors.push_back(from_blob(buffers[i].data(), p->shapes[i]));
  }
  for (auto& t : tensors) args.emplace_back(t);
  std::unique_ptr<executorch::extension::threadpool::NoThreadPoolGuard> single;
  if (g_single_thread) single = std::make_unique<executorch::extension::threadpool::NoThreadPoolGuard>();
  auto result = p->module->execute(kMethod, args);
  if (!result.ok()) {
    throw_java(env, "java/lang/IllegalStateException", "executing the program failed (error " +
               std::to_string(static_cast<int>(result.error())) + ")");
    return nullptr;
  }
  jobjectArray out = env->NewObjectArray(static_cast<jsize>(result->size()), env->FindClass("[F"), nullptr);
  for (size_t i = 0; i < result->size(); ++i) {
    const auto& value = (*result)[i];
    if (!value.isTensor() || value.toTensor().scalar_type() != ScalarType::Float) {
      throw_java(env, "java/lang/IllegalStateException", "output " + std::to_string(i) + " is not a float tensor");
      return nullptr;
    }
    const auto& tensor = value.toTensor();
    jfloatArray array = env->NewFloatArray(static_cast<jsize>(tensor.numel()));
    env->SetFloatArrayRegion(array, 0, static_cast<jsize>(tensor.numel()), tensor.const_data_ptr<float>());
    env->SetObjectArrayElement(out, static_cast<jsize>(i), array);
    env->DeleteLocalRef(array);
  }
  return out;
}

extern "C" JNIEXPORT void JNICALL Java_org_splitface_core_NativeProgram_free(JNIEnv*, jclass, jlong handle) {
  delete reinterpret_cast<Loaded*>(handle);
}

extern "C" JNIEXPORT void JNICALL Java_org_splitface_core_NativeProgram_setSingleThread(JNIEnv*, jclass, jboolean on) {
  g_single_thread = on == JNI_TRUE;
}
